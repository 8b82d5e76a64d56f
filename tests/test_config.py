"""One config schema for flags, -o options and TOML: validated at the door, every value's
source shown by `tierfs config --print`, and the docs made from the same table."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO
from tierfs import cli, config, docgen
from tierfs.errors import ConfigError


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_unknown_key_in_a_file_names_the_key_the_file_and_the_allowed_keys(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('ram = "1GiB"\nchunk_sise = "4MiB"\n')
    with pytest.raises(ConfigError) as e:
        config.resolve([(f"config file {f}", config.load_toml(str(f)))])
    msg = str(e.value)
    assert "'chunk_sise'" in msg and str(f) in msg
    assert "did you mean 'chunk_size'" in msg
    assert all(o.name in msg for o in config.OPTIONS)


@pytest.mark.parametrize("key,value,expect", [
    ("eviction", '"mru"', "expected one of nothrash, lru"),
    ("chunk_size", '"3k"', "multiple of 4KiB"),
    ("ram", '"12 bananas"', "expected a size like 16GiB"),
    ("depth", "0", "whole number 1..64"),
    ("writeback_deadline", '"soon"', "duration like 30s"),
    ("allow_other", '"maybe"', "true or false"),
    ("metrics_port", "70000", "whole number 0..65535"),
])
def test_bad_value_in_a_file_names_key_allowed_values_and_file(tmp_path: Path, key: str, value: str,
                                                                expect: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f"{key} = {value}\n")
    with pytest.raises(ConfigError) as e:
        config.resolve([(f"config file {f}", config.load_toml(str(f)))])
    msg = str(e.value)
    assert msg.startswith(f"{key}: "), msg
    assert expect in msg and str(f) in msg


def test_mount_options_bare_booleans_and_bare_keys_that_need_a_value() -> None:
    assert config.parse_mount_options("ram=1GiB, allow_other ,ssd=/x:2GiB") == {
        "ram": "1GiB", "allow_other": "true", "ssd": "/x:2GiB"}
    with pytest.raises(ConfigError, match=r"expected ram=VALUE \(size in bytes"):
        config.parse_mount_options("ram")


def test_layers_and_sources_file_then_flags_then_o(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.toml"
    f.write_text('ram = "1GiB"\nchunk_size = "8MiB"\ndepth = 2\nbacking = "/data/hdd"\n')
    rc, out, _ = run_cli(capsys, "config", "--print", "--config", str(f), "--depth", "3",
                         "-o", "depth=4,eviction=lru", "--ram", "2GiB")
    assert rc == 0
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in out.splitlines()}
    assert set(rows) == {o.name for o in config.OPTIONS}
    assert rows["chunk_size"] == ["8MiB", f"config file {f}"]
    assert rows["ram"] == ["2GiB", "flag --ram"]
    assert rows["depth"] == ["4", "-o"]  # -o wins over the flag, which wins over the file
    assert rows["eviction"] == ["lru", "-o"]
    assert rows["backing"] == ["/data/hdd", f"config file {f}"]
    assert rows["slice_size"] == ["auto", "default"]  # the backing profile decides (hdd: 32MiB)


def test_config_toml_output_reads_back_as_the_same_configuration(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "config", "--toml", "--ram", "3GiB", "-o",
                         "ssd=/nvme/t:400GiB,writeback_deadline=90s,allow_other,metrics_port=9200")
    assert rc == 0
    f = tmp_path / "out.toml"
    f.write_text(out)
    again = config.resolve([("file", config.load_toml(str(f)))])
    assert (again.ram, again.ssd, again.writeback_deadline, again.allow_other, again.metrics_port) == (
        3 << 30, ("/nvme/t", 400 << 30), 90.0, True, 9200)
    assert set(again.sources) == {"ram", "ssd", "writeback_deadline", "allow_other", "metrics_port"}


def test_bad_option_on_the_command_line_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "config", "-o", "read_ahead_kb=lots")
    assert rc == 2
    assert err.strip() == "tierfs: read_ahead_kb: expected a whole number 0..1048576, got 'lots' (-o)"


def test_mount_takes_the_backing_dir_from_the_config_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('backing = "/data/hdd"\nram = "1GiB"\n')
    args = cli.build_parser().parse_args(["mount", "--config", str(f), "/mnt/data"])
    cfg = cli._mount_config(args)
    assert (cfg.backing, cfg.mountpoint) == ("/data/hdd", "/mnt/data")
    args = cli.build_parser().parse_args(["mount", "--config", str(f), "/other", "/mnt/data"])
    assert cli._mount_config(args).backing == "/other"  # the argument wins


def test_example_toml_lists_every_option_and_each_line_is_valid_uncommented() -> None:
    text = (REPO / "mount" / "tierfs.example.toml").read_text()
    settings = re.findall(r"^#(\w+) = (.+?)(?:   # for example)?$", text, re.M)
    assert [k for k, _ in settings] == [o.name for o in config.OPTIONS]
    for key, value in settings:
        parsed = tomllib.loads(f"{key} = {value}")
        config.resolve([("example", parsed)])  # raises if a shown value is not valid
        opt = config.OPTION_BY_NAME[key]
        assert f"#   values: {config.describe(opt)}; default: {config.format_value(opt, opt.default)}" in text


def test_generated_files_are_up_to_date() -> None:
    assert docgen.stale() == [], "run: python -m tierfs.docgen"


def test_reference_lists_every_command_and_every_flag() -> None:
    ref = (REPO / "docs" / "reference.md").read_text()
    for name, sub in docgen.subcommands(cli.build_parser()).items():
        assert f"tierfs {name}" in ref, f"docs/reference.md does not document `tierfs {name}`"
        for flag in docgen.option_strings(sub):
            assert flag in ref, f"docs/reference.md does not document `tierfs {name} {flag}`"
    for o in config.OPTIONS:
        assert f"| `{o.name}` |" in ref


@pytest.mark.parametrize(("argv", "euid", "want"), [
    ([], 0, True),  # root mounts for everyone (as bindfs does); the kernel checks permissions
    ([], 1000, False),  # a user's own mount stays the user's (FUSE's default)
    (["--allow-other"], 1000, True),
    (["--no-allow-other"], 0, False),
    (["-o", "allow_other=false"], 0, False),
    (["-o", "allow_other=auto"], 0, True),
])
def test_allow_other_defaults_to_true_for_root(argv: list[str], euid: int, want: bool) -> None:
    args = cli.build_parser().parse_args(["mount", *argv, "/b", "/m"])
    cfg = cli._mount_config(args)
    assert config.effective_allow_other(cfg, euid) is want
    assert config.OPTION_BY_NAME["allow_other"].default is None  # "auto"


def test_who_can_use_the_mount_from_its_options() -> None:
    assert config.who_can_use({"allow_other", "default_permissions", "user_id=0"}) == (
        "all users (allow_other, permissions checked by the kernel)")
    assert config.who_can_use({"default_permissions", "user_id=1234"}) == "only uid 1234"
