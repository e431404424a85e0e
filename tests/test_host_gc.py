"""frozen_heap: the objects alive when a run starts are skipped by garbage collections during it."""

import gc

import pytest

from treegen.runtime.host_gc import frozen_heap


def test_the_heap_is_frozen_inside_once_however_nested_and_given_back_after():
    assert gc.get_freeze_count() == 0
    before = [object() for _ in range(3)]  # noqa: F841 (alive at entry)
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():  # a nested run freezes nothing more
            made = [[] for _ in range(10)]  # noqa: F841
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_the_caller_stays_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_an_error_inside_gives_the_heap_back():
    with pytest.raises(ValueError), frozen_heap():
        raise ValueError("inside")
    assert gc.get_freeze_count() == 0
