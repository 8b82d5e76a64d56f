# Two entry points: `make demo` (train a real model through a tierfs mount) and `make test`.
# Both install what is missing on a fresh Debian 12/13 machine (run as root).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
APT_PKGS := fuse3 libfuse3-dev pkg-config bindfs nbdkit nbdkit-plugin-python libnbd-bin fio e2fsprogs util-linux rsync tar

.PHONY: demo test bench posix posix-pjdfstest lint setup system-deps install uninstall clean

system-deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned, so that pip takes the local CPU build and not a CUDA download
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[torch,dev]'
	touch $@

setup: system-deps $(VENV)/.installed

demo: setup
	$(VPY) examples/demo.py

test: setup
	$(VPY) -m pytest -q

# the mount(8) helper (/sbin/mount.fuse.tierfs), /usr/local/bin/tierfs and the systemd unit
# tierfs@.service, as wrappers naming this checkout's .venv (docs/user-guide.md, section 10)
install: setup
	$(VPY) -m tierfs install-helper

uninstall:
	$(VPY) -m tierfs install-helper --uninstall

# the benchmarks of docs/benchmarks.md (each prints its table; root and a few minutes each)
bench: setup
	$(VPY) -m tierfs sim
	$(VPY) bench/bench_read.py
	$(VPY) bench/bench_hdd.py
	$(VPY) bench/bench_checkpoint.py
	$(VPY) bench/bench_collate.py
	$(VPY) bench/bench_fuse_ceiling.py

# POSIX conformance: pjdfstest (built outside this repo, see docs/posix.md) against a fresh
# --allow-other mount, and the same against POSIX_BASELINE (bindfs, ext4, tmpfs; comma-separated).
# Fails (exit 2, with the build recipe) if PJDFSTEST does not name a built pjdfstest.
PJDFSTEST ?= /tmp/pjdfstest
POSIX_BASELINE ?= bindfs,ext4
posix: posix-pjdfstest setup
	PJDFSTEST=$(PJDFSTEST) POSIX_BASELINE=$(POSIX_BASELINE) TIERFS_PYTHON=$(abspath $(VPY)) bench/posix.sh
posix-pjdfstest:
	@PJDFSTEST=$(PJDFSTEST) bench/posix.sh --check

lint: setup
	$(VENV)/bin/ruff check tierfs tierfs_hints tests examples
	$(VENV)/bin/mypy tierfs tierfs_hints

clean:
	rm -rf $(VENV) demo-data .bench
