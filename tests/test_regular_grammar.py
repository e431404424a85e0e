"""xgrammar grammars read as one regex (treegen/runtime/regular_grammar.py): the language of the
printed grammar, and None where it is not plainly regular. (That token automata built from these
regexes give xgrammar's masks is tested in test_token_automata.py.)"""

import json
import re

import pytest

from treegen.runtime.regular_grammar import grammar_regex

xgr = pytest.importorskip("xgrammar")


def schema_regex(schema: dict) -> str | None:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    return grammar_regex(str(grammar))


def ebnf_regex(text: str) -> str | None:
    return grammar_regex(str(xgr.Grammar.from_ebnf(text)))


def test_a_json_answer_schema_is_its_exact_language():
    regex = schema_regex({"type": "object", "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 9999}, "unit": {"enum": ["cows", "dollars"]},
        "sure": {"type": "boolean"}, "note": {"type": "integer"}},
        "required": ["answer", "unit", "sure"], "additionalProperties": False})
    assert regex is not None
    for text in ('{"answer": 0, "unit": "cows", "sure": true}', '{"answer": 9999, "unit": "dollars", "sure": false}',
                 '{"answer": 42, "unit": "cows", "sure": true, "note": -7}'):
        assert re.fullmatch(regex, text), text
    for text in ('{"answer": 10000, "unit": "cows", "sure": true}', '{"answer": 042, "unit": "cows", "sure": true}',
                 '{"answer":1, "unit": "cows", "sure": true}', '{"unit": "cows", "answer": 1, "sure": true}',
                 '{"answer": 1, "unit": "pigs", "sure": true}', '{"answer": 1, "unit": "cows"}'):
        assert not re.fullmatch(regex, text), text


def test_repetitions_optional_parts_and_right_recursion():
    regex = ebnf_regex('root ::= ("x" | "yz")+ " = " num? ";" [a-c\\]\\-]{2,3}\nnum ::= [1-9] [0-9]* | "0"')
    assert regex is not None
    for text in ("x = 12;ab", "yzx = ;]-", "x = 0;a-c"):
        assert re.fullmatch(regex, text), text
    for text in (" = 1;ab", "x = 01;ab", "x = 1;a", "xy = 1;ab"):
        assert not re.fullmatch(regex, text), text
    regex = ebnf_regex('root ::= "a" root | "b\\n\\t\\"" root | "c"')
    assert re.fullmatch(regex, 'ab\n\t"ac') and not re.fullmatch(regex, "ab")


@pytest.mark.parametrize("text", [
    'root ::= "(" root ")" | "x"',  # nesting: not regular
    'root ::= "x" mid\nmid ::= "y" root | "z"',  # recursion through another rule
])
def test_recursion_other_than_a_rule_s_tail_is_refused(text):
    assert ebnf_regex(text) is None


def test_free_strings_non_ascii_literals_and_malformed_text_are_refused():
    assert schema_regex({"type": "object", "properties": {"why": {"type": "string"}}}) is None  # a lookahead
    assert ebnf_regex('root ::= "café"') is None
    assert grammar_regex("root ::= (unknown)") is None
    assert grammar_regex('x ::= "a"') is None  # no root
    assert grammar_regex("root ::= [a-") is None
    assert grammar_regex('root ::= "\\q"') is None  # an escape this reader does not know


def test_macros_deep_rule_chains_and_escaped_punctuation():
    # xgrammar prints its regex macro as Regex("..."): never read as a rule of that name
    assert ebnf_regex('root ::= Regex("[a-c]+")\nRegex ::= "q"') is None
    # a schema of hundreds of keys is a chain of hundreds of rules: refused, not a RecursionError
    chain = "\n".join([f'root ::= "a" r0'] + [f'r{i} ::= "a" r{i + 1}' for i in range(2000)] + ['r2000 ::= "b"'])
    assert grammar_regex(chain) is None
    regex = schema_regex({"enum": ["a?b", "c*d"]})  # xgrammar prints "?" as "\?"
    assert re.fullmatch(regex, '"a?b"') and re.fullmatch(regex, '"c*d"') and not re.fullmatch(regex, '"ab"')
