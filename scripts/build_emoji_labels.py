"""Label every image of the bundled emoji set with its Unicode emoji group and subgroup.

    python scripts/build_emoji_labels.py [--emoji-test PATH] [--names assets/datasets/emoji64.json]
                                         [--out assets/datasets/emoji64_labels.json]

The groups and subgroups come from Unicode's emoji-test.txt (Debian's
`unicode-data` package ships it as /usr/share/unicode/emoji/emoji-test.txt;
without root: `apt-get download unicode-data && dpkg -x unicode-data_*.deb DIR`
and pass --emoji-test DIR/usr/share/unicode/emoji/emoji-test.txt). Only the
derived labels are committed, never the Unicode file.

How a glyph name (hex code points joined by "-", see build_emoji_dataset.py)
finds its line, first rule that matches wins:

  exact        the sequence, without FE0F variation selectors, is a line of the file
  reordered    the same code points in another order: the dataset builder joins
               ligature components in the font's GSUB order, which is not always
               the text order ("2640-200d-1f3c3" is woman running, 1F3C3 200D 2640)
  fallback     sequences newer than the file or never listed in it:
               - "facing right" (27A1) and skin tones (1F3FB..1F3FF) dropped,
                 so the glyph takes its base's subgroup
               - tag sequences (1F3F4 E00xx.. E007F) -> Flags / subdivision-flag,
                 black flag + cancel tag alone -> Flags / flag
               - lone regional indicators and Noto's private-use flags (FE4E5..FE4EE)
                 -> Flags / country-flag; lone keycap bases (#, *, 0-9), the
                 combining keycap (20E3) and Noto's private-use keycaps
                 (FE82C..FE837) -> Symbols / keycap
               - other ZWJ sequences -> the first component that the file lists,
                 skipping Symbols (the arrow of "head shaking" is not its class)

Subgroups with fewer than --min-class images are merged into "<group> (other)"
for the classifier's `class` field; `subgroup` always keeps the Unicode name.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.errors import InputError  # noqa: E402

DEFAULT_EMOJI_TEST = Path("/usr/share/unicode/emoji/emoji-test.txt")
VS16, ZWJ, KEYCAP, CANCEL_TAG, BLACK_FLAG, FACING_RIGHT = 0xFE0F, 0x200D, 0x20E3, 0xE007F, 0x1F3F4, 0x27A1
SKIN_TONES = frozenset(range(0x1F3FB, 0x1F400))
REGIONAL = range(0x1F1E6, 0x1F200)
NOTO_PUA_FLAGS = range(0xFE4E5, 0xFE4EF)
NOTO_PUA_KEYCAPS = range(0xFE82C, 0xFE838)
KEYCAP_BASES = frozenset([0x23, 0x2A, *range(0x30, 0x3A)])

LICENSE_NOTE = ("Groups and subgroups derived from Unicode emoji-test.txt (Unicode, Inc.), used under the "
                "Unicode License (Unicode License Agreement - Data Files and Software, which Unicode "
                "now publishes as the Unicode License v3; https://www.unicode.org/license.txt).")


def parse_emoji_test(path: Path) -> tuple[dict[tuple[int, ...], tuple[str, str]], str, list[str]]:
    """{code points without FE0F: (group, subgroup)}, the file's version, and groups/subgroups in file order."""
    if not path.is_file():
        raise InputError(f"emoji-test.txt not found at {path}; install Debian's unicode-data "
                         "(`apt-get install unicode-data`, or without root `apt-get download unicode-data "
                         "&& dpkg -x unicode-data_*.deb DIR`) and pass --emoji-test PATH")
    table: dict[tuple[int, ...], tuple[str, str]] = {}
    version, group, subgroup, order = "unknown", None, None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#\s*Version:\s*(\S+)", line):
            version = m.group(1)
        elif line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
        elif line.startswith("# subgroup:"):
            subgroup = line.split(":", 1)[1].strip()
            order.append(f"{group}/{subgroup}")
        elif line.strip() and not line.startswith("#"):
            cps = tuple(int(c, 16) for c in line.split(";")[0].split() if int(c, 16) != VS16)
            table.setdefault(cps, (group, subgroup))
    if not table:
        raise InputError(f"{path} has no emoji lines; is it Unicode's emoji-test.txt?")
    return table, version, order


class Labeller:
    def __init__(self, table: dict[tuple[int, ...], tuple[str, str]]):
        self.table = table
        self.by_set = {tuple(sorted(k)): v for k, v in table.items()}

    def _lookup(self, cps: tuple[int, ...]):
        return self.table.get(cps) or self.by_set.get(tuple(sorted(cps)))

    def label(self, name: str) -> tuple[str, str, str]:
        """(group, subgroup, how) for a dataset glyph name such as '1f469-200d-1f4bb'."""
        cps = tuple(int(c, 16) for c in name.split("-") if int(c, 16) != VS16)
        if cps in self.table:
            return (*self.table[cps], "exact")
        if (hit := self.by_set.get(tuple(sorted(cps)))) is not None:
            return (*hit, "reordered")
        return (*self._fallback(cps, name), "fallback")

    def _fallback(self, cps: tuple[int, ...], name: str) -> tuple[str, str]:
        if cps and cps[0] == BLACK_FLAG and cps[-1] == CANCEL_TAG:
            return ("Flags", "subdivision-flag") if len(cps) > 2 else ("Flags", "flag")
        if len(cps) == 1 and (cps[0] in REGIONAL or cps[0] in NOTO_PUA_FLAGS):
            return ("Flags", "country-flag")
        if len(cps) == 1 and (cps[0] in KEYCAP_BASES or cps[0] == KEYCAP or cps[0] in NOTO_PUA_KEYCAPS):
            return ("Symbols", "keycap")
        segments, seg = [], []
        for c in (*cps, ZWJ):          # split at ZWJ, drop the "facing right" segment and skin tones
            if c != ZWJ:
                seg += [] if c in SKIN_TONES else [c]
            elif seg and seg != [FACING_RIGHT]:
                segments.append(seg)
            if c == ZWJ:
                seg = []
        stripped = tuple(c for i, s in enumerate(segments) for c in ([ZWJ] if i else []) + s)
        if stripped and (hit := self._lookup(stripped)) is not None:
            return hit
        parts = [self.table[(c,)] for c in cps if (c,) in self.table]
        for hit in parts:
            if hit[0] != "Symbols":
                return hit
        if parts:
            return parts[0]
        raise InputError(f"glyph {name!r} matches no line of emoji-test.txt and no fallback rule; "
                         "add a rule to scripts/build_emoji_labels.py")


def build(names: list[str], table, version: str, order: list[str], min_class: int) -> dict:
    labeller = Labeller(table)
    rows = [labeller.label(n) for n in names]
    counts = Counter(f"{g}/{s}" for g, s, _ in rows)
    rank = {k: i for i, k in enumerate(order)}

    def cls(g: str, s: str) -> str:
        return f"{g}/{s}" if counts[f"{g}/{s}"] >= min_class else f"{g}/(other)"

    classes = sorted({cls(g, s) for g, s, _ in rows}, key=lambda c: (rank.get(c, len(rank)), c))
    # "(other)" classes sort after their group's last subgroup.
    group_order = list(dict.fromkeys(k.split("/")[0] for k in order))
    classes.sort(key=lambda c: (group_order.index(c.split("/")[0]), rank.get(c, len(rank))))
    groups = [g for g in group_order if any(r[0] == g for r in rows)]
    subgroups = sorted(counts, key=lambda k: rank.get(k, len(rank)))
    how = Counter(h for _, _, h in rows)
    return {
        "count": len(names),
        "source": f"Unicode emoji-test.txt, Version {version}",
        "license": LICENSE_NOTE,
        "names_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest(),
        "min_class": min_class,
        "matched": {"exact": how["exact"], "reordered": how["reordered"], "fallback": how["fallback"]},
        "groups": groups,
        "classes": classes,
        "subgroup_counts": dict(sorted(counts.items(), key=lambda kv: rank.get(kv[0], len(rank)))),
        # Per image, in dataset order: indices into `groups`, `subgroups` and `classes`, and how it matched.
        "subgroups": subgroups,
        "group": [groups.index(g) for g, _, _ in rows],
        "subgroup": [subgroups.index(f"{g}/{s}") for g, s, _ in rows],
        "class": [classes.index(cls(g, s)) for g, s, _ in rows],
        "match": "".join(h[0] for _, _, h in rows),
        "match_codes": {"e": "exact", "r": "reordered", "f": "fallback"},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emoji-test", type=Path, default=DEFAULT_EMOJI_TEST)
    ap.add_argument("--names", type=Path, default=ROOT / "assets" / "datasets" / "emoji64.json")
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "datasets" / "emoji64_labels.json")
    ap.add_argument("--min-class", type=int, default=5, help="merge subgroups with fewer images into '<group>/(other)'")
    args = ap.parse_args(argv)
    if not args.names.is_file():
        raise InputError(f"{args.names} not found; it is the dataset's JSON sidecar (scripts/build_emoji_dataset.py)")
    names = json.loads(args.names.read_text())["names"]
    table, version, order = parse_emoji_test(args.emoji_test)
    out = build(names, table, version, order, args.min_class)
    per_image = {k: out.pop(k) for k in ("group", "subgroup", "class", "match")}
    text = json.dumps(out, indent=1)[:-2] + ",\n" + ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in per_image.items()) + "\n}\n"
    args.out.write_text(text)
    m = out["matched"]
    print(f"{out['count']} images -> {args.out}: {m['exact']} exact, {m['reordered']} reordered, "
          f"{m['fallback']} by fallback; {len(out['groups'])} groups, {len(out['classes'])} classes "
          f"({len(out['subgroup_counts'])} subgroups, those under {args.min_class} images merged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
