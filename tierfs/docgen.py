"""Files made from the code, so that they cannot drift from it.

``python -m tierfs.docgen`` rewrites them; ``python -m tierfs.docgen --check`` exits 1 if one is
out of date (a test runs the check):

* the option table of ``docs/reference.md`` (between ``<!-- options:begin -->`` and
  ``<!-- options:end -->``), from :data:`tierfs.config.OPTIONS`;
* ``mount/tierfs.example.toml``: every option, commented out, with its unit and default;
* ``mount/tierfs@.service``: the systemd unit template (:data:`tierfs.helper.UNIT`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from tierfs import config, helper

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"
# a value to show for options whose default is "unset"
EXAMPLES = {"ssd": "/nvme/tierfs:400GiB", "log_file": "syslog", "backing": "/data/hdd"}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of ``parser`` (``{"mount": ..., "stats": ...}``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` of ``parser`` (help and hidden ones excepted)."""
    return [s for a in parser._actions if a.help != argparse.SUPPRESS
            for s in a.option_strings if s.startswith("--") and s != "--help"]


def _mount_flags() -> set[str]:
    from tierfs.cli import build_parser

    return set(option_strings(subcommands(build_parser())["mount"]))


def options_table() -> str:
    flags = _mount_flags()
    rows = ["| key | default | values | flag | meaning |", "|---|---|---|---|---|"]
    for o in config.OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        rows.append(f"| `{o.name}` | `{config.format_value(o, o.default)}` | {config.describe(o)} | "
                    f"{f'`{flag}`' if flag in flags else ''} | {o.help} |")
    return "\n".join(rows) + "\n"


def reference(text: str) -> str:
    """``text`` (docs/reference.md) with its option table regenerated."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"docs/reference.md lacks the {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{options_table()}{END}{tail}"


def example_toml() -> str:
    out = [
        "# tierfs configuration: every option, commented out at its default.",
        "#",
        "# Use it with `tierfs mount --config FILE [BACKING] MOUNTPOINT`, with `config=FILE` in an",
        "# /etc/fstab line, or as /etc/tierfs/<instance>.toml for the tierfs@.service unit. The keys",
        "# are those of `tierfs mount -o key=value`; later layers win: this file, then flags, then -o.",
        "# Sizes: 16GiB, 512M (powers of 1024), 500MB (powers of 1000) or bytes. Durations: seconds,",
        "# or 250ms, 2.5s, 10m, 1h. `tierfs config --print --config FILE` shows what is in effect.",
        "# (Generated from tierfs/config.py by `python -m tierfs.docgen`.)",
    ]
    for o in config.OPTIONS:
        out.append("")
        for line in textwrap.wrap(f"{o.name}: {o.help}", 94):
            out.append(f"# {line}")
        out.append(f"#   values: {config.describe(o)}; default: {config.format_value(o, o.default)}")
        if o.default in (None, "") and o.name in EXAMPLES:
            example = o.parse(EXAMPLES[o.name], o.name)
            out.append(f"#{o.name} = {config.toml_value(o, example)}   # for example")
        else:
            out.append(f"#{o.name} = {config.toml_value(o, o.default)}")
    return "\n".join(out) + "\n"


def outputs() -> dict[Path, str]:
    """Each generated file and its content."""
    ref = REPO / "docs" / "reference.md"
    return {
        ref: reference(ref.read_text()),
        REPO / "mount" / "tierfs.example.toml": example_toml(),
        REPO / "mount" / helper.UNIT_NAME: helper.unit(),
    }


def stale() -> list[Path]:
    """The generated files that differ from what the code makes now."""
    return [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierfs.docgen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a generated file is out of date")
    args = p.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"out of date: {path.relative_to(REPO)} (run python -m tierfs.docgen)")
        return 1 if old else 0
    for path, text in outputs().items():
        path.parent.mkdir(exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
