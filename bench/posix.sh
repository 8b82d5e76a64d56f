#!/usr/bin/env bash
# POSIX conformance of a tierfs mount: runs pjdfstest (https://github.com/pjd/pjdfstest, built
# outside this repository) from a directory inside a fresh mount and prints, per test directory,
# the test files, subtests and failures; optionally the same against baselines (bindfs over the
# same kind of backing directory, a loop-mounted ext4, a tmpfs) so the numbers compare in one run.
#
#   PJDFSTEST=/tmp/pjdfstest bench/posix.sh                        # tierfs only
#   PJDFSTEST=/tmp/pjdfstest bench/posix.sh --baseline bindfs --baseline ext4
#   PJDFSTEST=/tmp/pjdfstest bench/posix.sh --only rename,chmod --baseline ext4
#   PJDFSTEST=/tmp/pjdfstest bench/posix.sh --skip-tierfs --baseline tmpfs
#
# Needs root (pjdfstest changes uids and creates device nodes; mounts). Every mount is made under
# one temp directory and unmounted, and the temp directories removed, by an EXIT trap that runs
# whatever happens (Ctrl-C included). The per-file TAP logs and the list of failed subtests stay
# in the results directory (--out, default a new /tmp/tierfs-posix.XXXXXX) for triage.
# docs/posix.md explains the table and the failures a local ext4 also shows.
set -uo pipefail
# the whole script is one compound command, so bash parses all of it before it runs: editing
# this file while a run is in progress cannot change what that run executes
{

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${TIERFS_SRC:-$(cd "$HERE/.." && pwd)}   # the checkout whose tierfs code is mounted
PY=${TIERFS_PYTHON:-$SRC/.venv/bin/python}
PJDFSTEST=${PJDFSTEST:-}
TARGETS=()
SKIP_TIERFS=0
CHECK_ONLY=0
REPORT=""
ONLY=""
OUT=""
FILE_TIMEOUT=${POSIX_FILE_TIMEOUT:-600}   # seconds per test file (a FUSE hang must not stall the run)
TIERFS_ARGS=()
[ -n "${POSIX_BASELINE:-}" ] && IFS=, read -r -a TARGETS <<<"$POSIX_BASELINE"

usage() {
	cat <<EOF
usage: PJDFSTEST=DIR $0 [--baseline bindfs|ext4|tmpfs ...] [--skip-tierfs] [--only DIR,DIR] [--check]
                     [--src CHECKOUT] [--python PY] [--out DIR] [--tierfs-arg ARG ...]

  PJDFSTEST         a built pjdfstest checkout (DIR/pjdfstest and DIR/tests); see docs/posix.md
  --baseline NAME   also run against NAME (repeatable or comma-separated; env POSIX_BASELINE):
                    bindfs (bindfs over a temp backing dir), ext4 (a loop-mounted image), tmpfs
  --skip-tierfs     run only the baselines
  --only LIST       only these test directories (e.g. rename,chmod)
  --report OUT      only print the table of an earlier run's results directory
  --check           only check that PJDFSTEST names a built pjdfstest (exit 2 if not)
  --src CHECKOUT    mount the tierfs code of this checkout (default: this one; env TIERFS_SRC)
  --python PY       the Python with tierfs' dependencies (default CHECKOUT/.venv/bin/python;
                    env TIERFS_PYTHON)
  --out DIR         keep logs and results here (default: a new /tmp/tierfs-posix.XXXXXX)
  --tierfs-arg ARG  one more argument for 'tierfs mount' (repeatable)
EOF
}

while [ $# -gt 0 ]; do
	case "$1" in
	--baseline) IFS=, read -r -a more <<<"$2"; TARGETS+=("${more[@]}"); shift 2 ;;
	--baseline=*) IFS=, read -r -a more <<<"${1#*=}"; TARGETS+=("${more[@]}"); shift ;;
	--skip-tierfs) SKIP_TIERFS=1; shift ;;
	--check) CHECK_ONLY=1; shift ;;
	--report) REPORT=$2; shift 2 ;;
	--only) ONLY=$2; shift 2 ;;
	--src) SRC=$(cd "$2" && pwd); PY=${TIERFS_PYTHON:-$SRC/.venv/bin/python}; shift 2 ;;
	--python) PY=$2; shift 2 ;;
	--out) OUT=$2; shift 2 ;;
	--tierfs-arg) TIERFS_ARGS+=("$2"); shift 2 ;;
	-h|--help) usage; exit 0 ;;
	*) echo "posix.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
	esac
done
[ $SKIP_TIERFS -eq 1 ] || TARGETS=(tierfs "${TARGETS[@]}")

die() { echo "posix.sh: $*" >&2; exit 2; }

if [ -z "$PJDFSTEST" ] || [ ! -x "$PJDFSTEST/pjdfstest" ] || [ ! -d "$PJDFSTEST/tests" ]; then
	cat >&2 <<EOF
posix.sh: pjdfstest not found (PJDFSTEST=${PJDFSTEST:-unset}). Build it outside this repository:
    apt-get install -y autoconf automake libtool gcc make perl
    git clone https://github.com/pjd/pjdfstest /tmp/pjdfstest
    cd /tmp/pjdfstest && autoreconf -ifs && ./configure && make pjdfstest
then run:  make posix PJDFSTEST=/tmp/pjdfstest    (docs/posix.md)
EOF
	exit 2
fi
PJDFSTEST=$(cd "$PJDFSTEST" && pwd)
[ $CHECK_ONLY -eq 0 ] || { echo "posix.sh: pjdfstest found in $PJDFSTEST"; exit 0; }
[ "$(id -u)" -eq 0 ] || die "needs root (pjdfstest switches uids; the baselines mount)"
command -v prove >/dev/null || die "prove (perl) is missing: apt-get install perl"

# test directories, in pjdfstest's order
DIRS=()
for d in "$PJDFSTEST"/tests/*/; do
	d=$(basename "$d")
	if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$d,"* ]]; then continue; fi
	ls "$PJDFSTEST/tests/$d"/*.t >/dev/null 2>&1 && DIRS+=("$d")
done
[ ${#DIRS[@]} -gt 0 ] || die "no test directories match --only $ONLY"

[ -z "$REPORT" ] || OUT=$REPORT
[ -n "$OUT" ] || OUT=$(mktemp -d /tmp/tierfs-posix.XXXXXX)
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/tierfs-posix-mnt.XXXXXX)
# pjdfstest switches to other uids, which must reach the directory it runs in
chmod 0755 "$WORK"
MOUNTS=()      # mountpoints to unmount at exit, in order of mounting
RAMDIRS=()     # RAM tier parents under /dev/shm

unmount_one() {
	local mnt=$1 i
	if [ "${MNT_KIND[$mnt]:-}" = tierfs ]; then
		(cd "$SRC" && PYTHONPATH="$SRC" timeout 120 "$PY" -m tierfs umount "$mnt") >/dev/null 2>&1
	fi
	for i in 1 2 3 4 5 6 7 8 9 10; do
		mountpoint -q "$mnt" || return 0
		fusermount3 -u "$mnt" 2>/dev/null || umount "$mnt" 2>/dev/null
		mountpoint -q "$mnt" || return 0
		sleep 0.5
	done
	echo "posix.sh: $mnt still busy; lazy unmount" >&2
	umount -l "$mnt" 2>/dev/null
}

cleanup() {
	local i
	cd /
	for (( i=${#MOUNTS[@]}-1; i>=0; i-- )); do unmount_one "${MOUNTS[$i]}"; done
	MOUNTS=()
	for d in "${RAMDIRS[@]}"; do rm -rf "$d"; done
	RAMDIRS=()
	if ! grep -q " $WORK/" /proc/mounts; then rm -rf "$WORK"; else echo "posix.sh: left $WORK (still mounted)" >&2; fi
}
trap cleanup EXIT
CHILD=""
# timeout(1) passes the signal on to prove
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; wait; exit 130' INT TERM HUP
declare -A MNT_KIND

# mount_TARGET: sets TESTROOT (an empty 0755 directory inside the filesystem under test)
mount_tierfs() {
	local base=$WORK/tierfs ram
	mkdir -p "$base"/{backing,ssd,mnt}
	chmod 0755 "$base" "$base/backing" "$base/mnt"
	chmod 0700 "$base/ssd"   # tierfs refuses a tier other users can reach
	ram=$(mktemp -d /dev/shm/tierfs-posix.XXXXXX); RAMDIRS+=("$ram")
	MNT_KIND[$base/mnt]=tierfs; MOUNTS+=("$base/mnt")
	if ! (cd "$SRC" && PYTHONPATH="$SRC" "$PY" -m tierfs mount "$base/backing" "$base/mnt" \
		--allow-other --ram 256MiB --ssd "$base/ssd:1GiB" -o "ram_dir=$ram" \
		${TIERFS_ARGS[@]+"${TIERFS_ARGS[@]}"}) >"$OUT/tierfs-mount.log" 2>&1; then
		cat "$OUT/tierfs-mount.log" >&2; die "tierfs mount failed"
	fi
	mountpoint -q "$base/mnt" || die "tierfs mount returned but nothing is mounted on $base/mnt"
	TESTROOT=$base/mnt/pjdfstest
}

mount_bindfs() {
	local base=$WORK/bindfs
	mkdir -p "$base"/{backing,mnt}
	chmod 0755 "$base" "$base/backing" "$base/mnt"
	MNT_KIND[$base/mnt]=bindfs; MOUNTS+=("$base/mnt")
	bindfs "$base/backing" "$base/mnt" >"$OUT/bindfs-mount.log" 2>&1 || { cat "$OUT/bindfs-mount.log" >&2; die "bindfs failed"; }
	TESTROOT=$base/mnt/pjdfstest
}

mount_ext4() {
	local base=$WORK/ext4
	mkdir -p "$base/mnt"
	chmod 0755 "$base" "$base/mnt"
	truncate -s 1G "$base/image"
	mkfs.ext4 -q -F "$base/image" >/dev/null || die "mkfs.ext4 failed"
	MNT_KIND[$base/mnt]=ext4; MOUNTS+=("$base/mnt")
	mount -o loop "$base/image" "$base/mnt" || die "mount -o loop failed (no loop devices here?)"
	TESTROOT=$base/mnt/pjdfstest
}

mount_tmpfs() {
	local base=$WORK/tmpfs
	mkdir -p "$base/mnt"
	chmod 0755 "$base" "$base/mnt"
	MNT_KIND[$base/mnt]=tmpfs; MOUNTS+=("$base/mnt")
	mount -t tmpfs -o size=1G,mode=0755 tmpfs "$base/mnt" || die "mounting a tmpfs failed"
	TESTROOT=$base/mnt/pjdfstest
}

# parse one TAP log: prints "planned passed todo_failed"
tap_counts() {
	awk '
		/^1\.\.[0-9]+/ { split($0, a, "\\.\\."); plan = a[2] + 0 }
		/^ok [0-9]+/ { ok++ }
		/^not ok [0-9]+.*# TODO/ { todo++; next }
		/^not ok [0-9]+/ { nok++ }
		END { if (plan == "") plan = ok + todo + nok; print plan + 0, ok + 0, todo + 0 }
	' "$1"
}

run_target() {
	local target=$1 dir f rel log t0 t1 plan ok todo fail
	mount_"$target"
	mkdir "$TESTROOT" && chmod 0755 "$TESTROOT" || die "cannot create $TESTROOT"
	mkdir -p "$OUT/$target"
	: >"$OUT/$target/results.tsv"
	: >"$OUT/$target/failed.txt"
	echo "== $target: $(findmnt -no FSTYPE -T "$TESTROOT") at $TESTROOT (logs: $OUT/$target)" >&2
	t0=$(date +%s)
	for dir in "${DIRS[@]}"; do
		for f in "$PJDFSTEST/tests/$dir"/*.t; do
			rel=$dir/$(basename "$f")
			log=$OUT/$target/${rel//\//_}.log
			# each file runs in a fresh directory inside the mount, as prove -r would from it
			# in the background and waited for, so that a signal ends the run at once (bash
			# runs a trap only after the foreground command it waits for has finished)
			(cd "$TESTROOT" && exec timeout -k 10 "$FILE_TIMEOUT" prove -v "$f") >"$log" 2>&1 &
			CHILD=$!
			wait $CHILD
			CHILD=""
			read -r plan ok todo < <(tap_counts "$log")
			fail=$(( plan - ok - todo ))
			[ $fail -lt 0 ] && fail=0
			printf '%s\t%s\t%d\t%d\n' "$dir" "$rel" "$plan" "$fail" >>"$OUT/$target/results.tsv"
			grep -E '^not ok [0-9]+' "$log" | grep -v '# TODO' | sed "s|^|$rel: |" >>"$OUT/$target/failed.txt"
			if [ "$plan" -gt $(( ok + todo + $(grep -cE '^not ok [0-9]+' "$log") )) ]; then
				echo "$rel: $(( plan - ok - todo - $(grep -cE '^not ok [0-9]+' "$log") )) subtests never ran (script died or timed out)" >>"$OUT/$target/failed.txt"
			fi
		done
		printf '   %-16s %5d failed so far\n' "$dir" "$(awk -F'\t' '{s+=$4} END {print s+0}' "$OUT/$target/results.tsv")" >&2
	done
	t1=$(date +%s)
	echo $(( t1 - t0 )) >"$OUT/$target/seconds"
	cd /
	rm -rf "$TESTROOT" 2>/dev/null
	cleanup_target
}

cleanup_target() {
	# unmount what run_target mounted (the EXIT trap covers failures)
	local i
	for (( i=${#MOUNTS[@]}-1; i>=0; i-- )); do unmount_one "${MOUNTS[$i]}"; done
	MOUNTS=()
	for d in "${RAMDIRS[@]}"; do rm -rf "$d"; done
	RAMDIRS=()
}

# the table: one row per test directory, then the totals
print_table() {
	printf '%-18s %6s %9s' "test dir" files subtests
	for t in "${TARGETS[@]}"; do printf ' %9s' "$t"; done
	printf '\n'
	for dir in "${DIRS[@]}" TOTAL; do
		first=${TARGETS[0]}
		if [ "$dir" = TOTAL ]; then sel='1'; else sel="\$1 == \"$dir\""; fi
		files=$(awk -F'\t' "$sel {n++} END {print n+0}" "$OUT/$first/results.tsv")
		subs=$(awk -F'\t' "$sel {s+=\$3} END {print s+0}" "$OUT/$first/results.tsv")
		printf '%-18s %6d %9d' "$dir" "$files" "$subs"
		for t in "${TARGETS[@]}"; do
			printf ' %9d' "$(awk -F'\t' "$sel {s+=\$4} END {print s+0}" "$OUT/$t/results.tsv")"
		done
		printf '\n'
	done
	printf '%-35s' "seconds per run"
	for t in "${TARGETS[@]}"; do printf ' %9s' "$(cat "$OUT/$t/seconds" 2>/dev/null || echo '?')"; done
	printf '\n'
}

if [ -n "$REPORT" ]; then
	# reprint the table of an earlier run from its results directory
	OUT=$REPORT
	TARGETS=()
	for t in tierfs bindfs ext4 tmpfs; do [ -s "$OUT/$t/results.tsv" ] && TARGETS+=("$t"); done
	[ ${#TARGETS[@]} -gt 0 ] || die "no results in $OUT"
	DIRS=($(cut -f1 "$OUT/${TARGETS[0]}/results.tsv" | uniq))
	trap - EXIT
	rm -rf "$WORK"
	print_table
	exit 0
fi
for t in "${TARGETS[@]}"; do
	case "$t" in
	tierfs) [ -x "$PY" ] || die "no Python at $PY (make setup, or --python / TIERFS_PYTHON)" ;;
	bindfs) command -v bindfs >/dev/null || die "bindfs is missing: apt-get install bindfs" ;;
	ext4) command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 is missing: apt-get install e2fsprogs" ;;
	tmpfs) ;;
	*) die "unknown baseline '$t' (bindfs, ext4, tmpfs)" ;;
	esac
done
for t in "${TARGETS[@]}"; do run_target "$t"; done
print_table | tee "$OUT/table.txt"
echo "failed subtests: $OUT/<target>/failed.txt; TAP logs: $OUT/<target>/*.log" >&2
exit 0
}
