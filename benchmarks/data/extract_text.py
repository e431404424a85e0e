"""Re-create ``persuasion_ch1.txt`` from Debian's ``r-cran-janeaustenr`` package (see README.md).

    apt-get download r-cran-janeaustenr        # 1.0.0-1
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb pkg
    python benchmarks/data/extract_text.py pkg/usr/lib/R/site-library/janeaustenr/data > persuasion_ch1.txt

The package keeps its texts in R's lazy-load database (``Rdata.rdb``, indexed by ``Rdata.rdx``): each
novel is a character vector of lines, serialized in R's XDR format and zlib-compressed. This reads
``persuasion`` with a minimal XDR reader (character vectors, lists, pairlists; no R needed) and
prints its lines up to the heading of chapter 2, without the trailing blank lines.
"""

import gzip
import struct
import sys
import zlib
from pathlib import Path


class _XDR:
    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.b, self.i, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # R version writing, minimal R version reading
        if version == 3:
            n = self.int()
            self.i += n  # native encoding name

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & 0x200, flags & 0x400
        if kind == 254:  # NULL
            return None
        if kind == 1:  # symbol (later uses refer back to it)
            self.refs.append(("symbol", self.item()))
            return self.refs[-1]
        if kind == 255:  # reference to an earlier symbol
            return self.refs[(flags >> 8 or self.int()) - 1]
        if kind == 2:  # pairlist: [attr] [tag] car cdr
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return [(tag, car)] + (cdr or [])
        if kind == 9:  # string
            n = self.int()
            if n == -1:
                return None
            s = self.b[self.i : self.i + n].decode("utf-8")
            self.i += n
            return s
        if kind in (13, 10):  # integer, logical
            value = [self.int() for _ in range(self.int())]
        elif kind == 14:  # double
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.b, self.i))
            self.i += 8 * n
        elif kind in (16, 19):  # character vector, list
            value = [self.item() for _ in range(self.int())]
        else:
            raise ValueError(f"unsupported R type {kind}")
        if has_attr:
            attrs = {tag[1]: v for tag, v in self.item()}
            if "names" in attrs:
                return dict(zip(attrs["names"], value))
        return value


def read_object(folder: Path, name: str) -> list:
    index = _XDR(gzip.decompress((folder / "Rdata.rdx").read_bytes())).item()
    offset, length = index["variables"][name]
    blob = (folder / "Rdata.rdb").read_bytes()[offset : offset + length]
    return _XDR(zlib.decompress(blob[4:])).item()  # 4 bytes of uncompressed length, then zlib


def main() -> None:
    lines = [line or "" for line in read_object(Path(sys.argv[1]), "persuasion")]
    end = lines.index("Chapter 2")
    sys.stdout.write("\n".join(lines[:end]).rstrip() + "\n")


if __name__ == "__main__":
    main()
