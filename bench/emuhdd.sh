#!/bin/bash
# Emulated 7200 rpm hard disk for benchmarks (run as root).
#
#   bench/emuhdd.sh up WORKDIR SIZE_GIB   set up; the last line of stdout is the ext4 mount dir
#   bench/emuhdd.sh down WORKDIR          tear down (idempotent, safe after a partial `up`)
#   bench/emuhdd.sh dropcache WORKDIR     drop the page cache of the emulated disk
#   bench/emuhdd.sh status WORKDIR        print what is set up
#
# Stack:  nbdkit python plugin (bench/emuhdd/hdd_model.py: Ruemmler-Wilkes disk model, one
#         request at a time, data in an anonymous mmap)  --unix WORKDIR/nbd.sock-->
#         nbdfuse (exposes the export as WORKDIR/fuse/disk)  -->
#         loop device (direct-io on, max_sectors_kb=1024, read_ahead_kb=128, rotational=1)  -->
#         ext4 (mkfs with no lazy init, mounted noatime,no_prefetch_block_bitmaps) at WORKDIR/mnt
#
# Everything lives under WORKDIR: pid files, the loop device name (WORKDIR/loopdev), logs
# (nbdkit.log, nbdfuse.log) and the per-request log of the plugin (requests.log:
# "wall_time op offset length model_s actual_s").  While WORKDIR/nodelay exists the plugin does
# not sleep (used for mkfs and for filling the disk quickly).
#
# dropcache: `sync`, then unmount the ext4, `blockdev --flushbufs` the loop device, mount again.
# Unmounting evicts every page-cache page and inode of that file system only, so nothing else on
# the machine is disturbed.  If the unmount fails (files held open), it falls back to
# `blockdev --flushbufs` + `echo 1 > /proc/sys/vm/drop_caches` (global).  Below the loop device
# nothing caches: the loop uses direct I/O on the FUSE file (if direct-io could not be enabled,
# the global drop is done as well, for the FUSE file's own cache).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PLUGIN="$HERE/emuhdd/hdd_model.py"
MAX_SECTORS_KB=${EMUHDD_MAX_SECTORS_KB:-1024}
READ_AHEAD_KB=${EMUHDD_READ_AHEAD_KB:-128}
SCHED=${EMUHDD_SCHED:-none}          # I/O scheduler of the loop device (none = arrival order)
NBDKIT_ARGS=${EMUHDD_NBDKIT_ARGS:-}  # extra key=value for the plugin, e.g. "rotation=uniform"
NICE=${EMUHDD_NICE:--10}             # nbdkit and nbdfuse run at this nice level (CPU contention)
NICE_ADJ=$(( NICE - $(nice) ))       # `nice -n` is relative to our own niceness
# no_prefetch_block_bitmaps: else ext4 reads all block bitmaps in the background after each
# mount, which would interleave with the measured reads
MOUNT_OPTS=${EMUHDD_MOUNT_OPTS:-noatime,no_prefetch_block_bitmaps}

log() { echo "emuhdd: $*" >&2; }
die() { log "error: $*"; exit 1; }

# pid from FILE if that process is alive and its command line contains NAME
live_pid() {
    local file=$1 name=$2 pid
    [[ -s $file ]] || return 1
    pid=$(cat "$file" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q -- "$name" || return 1
    echo "$pid"
}

is_mounted() { # exact mount point in /proc/mounts (works for dead FUSE mounts too)
    awk -v m="$1" '$2 == m { found = 1 } END { exit !found }' /proc/mounts
}

# loop devices whose backing file is WORKDIR/fuse/disk (from sysfs: no stat of the FUSE file)
sys_loops_of() {
    local w=$1 f dev
    for f in /sys/block/loop*/loop/backing_file; do
        [[ -r $f ]] || continue
        if [[ "$(cat "$f" 2>/dev/null)" == "$w/fuse/disk"* ]]; then
            dev=${f#/sys/block/}; echo "/dev/${dev%%/*}"
        fi
    done
}

kill_wait() { # kill_wait PID: TERM, wait up to 5 s, then KILL
    local pid=$1 i
    kill "$pid" 2>/dev/null || return 0
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

cmd_down() {
    local w=$1 i dev pid
    [[ -d $w ]] || { log "down: $w does not exist, nothing to do"; return 0; }
    if is_mounted "$w/mnt"; then
        for i in 1 2 3 4 5; do umount "$w/mnt" 2>/dev/null && break; sleep 0.5; done
        if is_mounted "$w/mnt"; then log "umount $w/mnt busy; lazy unmount"; umount -l "$w/mnt" || true; fi
    fi
    for dev in $(sys_loops_of "$w"); do
        losetup -d "$dev" 2>/dev/null || log "losetup -d $dev failed"
    done
    # losetup -d is asynchronous while the device is still open: wait for the detach
    for i in $(seq 50); do [[ -z "$(sys_loops_of "$w")" ]] && break; sleep 0.1; done
    [[ -z "$(sys_loops_of "$w")" ]] || log "warning: loop device(s) still attached: $(sys_loops_of "$w")"
    if is_mounted "$w/fuse"; then
        fusermount3 -u "$w/fuse" 2>/dev/null || { sleep 1; fusermount3 -u "$w/fuse" 2>/dev/null; } \
            || { log "fusermount3 -u failed; lazy unmount"; fusermount3 -uz "$w/fuse" 2>/dev/null || umount -l "$w/fuse" || true; }
    fi
    if pid=$(live_pid "$w/nbdfuse.pid" nbdfuse); then
        for i in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill_wait "$pid"
    fi
    if pid=$(live_pid "$w/nbdkit.pid" nbdkit); then kill_wait "$pid"; fi
    rm -f "$w/nbdfuse.pid" "$w/nbdkit.pid" "$w/nbd.sock" "$w/loopdev" "$w/nodelay"
    rmdir "$w/mnt" "$w/fuse" 2>/dev/null || true
    log "down: $w torn down"
    return 0
}

cmd_up() {
    local w=$1 size_gib=$2 i loop name
    [[ $size_gib =~ ^[0-9]+$ && $size_gib -ge 1 ]] || die "SIZE_GIB must be a positive integer"
    [[ $EUID -eq 0 ]] || die "must run as root"
    mkdir -p "$w" && w=$(cd "$w" && pwd)
    if is_mounted "$w/mnt" || is_mounted "$w/fuse" || live_pid "$w/nbdkit.pid" nbdkit >/dev/null; then
        die "$w is already (partly) set up; run: $0 down $w"
    fi
    UP_OK=0 UP_W=$w  # globals: the EXIT trap may run outside this function's scope
    trap '[[ $UP_OK == 1 ]] || { log "up failed; tearing down"; cmd_down "$UP_W"; }' EXIT
    trap 'exit 130' INT TERM
    set -e
    mkdir -p "$w/fuse" "$w/mnt"
    touch "$w/nodelay"
    rm -f "$w/nbd.sock" "$w/nbdkit.pid" "$w/nbdfuse.pid"
    # nbdkit forks into the background once the socket is ready and writes the pid file
    # shellcheck disable=SC2086
    nice -n "$NICE_ADJ" nbdkit --log=stderr -U "$w/nbd.sock" -P "$w/nbdkit.pid" python "$PLUGIN" \
        size="${size_gib}G" log="$w/requests.log" ctl="$w" $NBDKIT_ARGS 2>>"$w/nbdkit.log"
    for i in $(seq 100); do [[ -S $w/nbd.sock && -s $w/nbdkit.pid ]] && break; sleep 0.1; done
    live_pid "$w/nbdkit.pid" nbdkit >/dev/null || die "nbdkit did not start (see $w/nbdkit.log)"

    setsid nice -n "$NICE_ADJ" nbdfuse -P "$w/nbdfuse.pid" "$w/fuse/disk" --unix "$w/nbd.sock" \
        </dev/null >>"$w/nbdfuse.log" 2>&1 &
    for i in $(seq 100); do [[ -s $w/nbdfuse.pid ]] && is_mounted "$w/fuse" && break; sleep 0.1; done
    is_mounted "$w/fuse" || die "nbdfuse did not mount (see $w/nbdfuse.log)"

    if ! loop=$(losetup --find --show --direct-io=on "$w/fuse/disk" 2>>"$w/nbdfuse.log"); then
        die "losetup failed"
    fi
    echo "$loop" >"$w/loopdev"
    name=${loop#/dev/}
    if [[ "$(cat "/sys/block/$name/loop/dio")" != 1 ]]; then
        log "warning: direct-io could not be enabled on $loop (FUSE file pages will be cached too)"
    fi
    # read_ahead_kb last: writing the other queue attributes re-applies the queue limits, which
    # resets read_ahead_kb (to 2048 on this kernel)
    echo 1 >"/sys/block/$name/queue/rotational"
    echo "$SCHED" >"/sys/block/$name/queue/scheduler" 2>/dev/null || log "could not set scheduler $SCHED"
    echo "$MAX_SECTORS_KB" >"/sys/block/$name/queue/max_sectors_kb"
    echo "$READ_AHEAD_KB" >"/sys/block/$name/queue/read_ahead_kb"

    mkfs.ext4 -F -q -m 0 -L emuhdd -E lazy_itable_init=0,lazy_journal_init=0,nodiscard "$loop" >&2
    mount -o "$MOUNT_OPTS" "$loop" "$w/mnt"
    sync
    [[ "$(cat "/sys/block/$name/queue/read_ahead_kb")" == "$READ_AHEAD_KB" ]] \
        || die "read_ahead_kb of $loop is $(cat "/sys/block/$name/queue/read_ahead_kb"), not $READ_AHEAD_KB"
    rm -f "$w/nodelay"
    set +e
    UP_OK=1
    log "up: $loop ($(cat "/sys/block/$name/queue/max_sectors_kb") KiB max request, read_ahead $(cat "/sys/block/$name/queue/read_ahead_kb") KiB, dio=$(cat "/sys/block/$name/loop/dio"), scheduler: $(cat "/sys/block/$name/queue/scheduler"))"
    echo "$w/mnt"
}

cmd_dropcache() {
    local w=$1 loop global=0
    [[ -s $w/loopdev ]] || die "$w is not set up"
    loop=$(cat "$w/loopdev")
    sync
    if is_mounted "$w/mnt" && umount "$w/mnt" 2>/dev/null; then
        blockdev --flushbufs "$loop"
        mount -o "$MOUNT_OPTS" "$loop" "$w/mnt" || die "remount of $loop failed"
        log "dropcache: remounted $w/mnt (per-device)"
    else
        blockdev --flushbufs "$loop"
        global=1
    fi
    [[ "$(cat "/sys/block/${loop#/dev/}/loop/dio" 2>/dev/null)" == 1 ]] || global=1
    if [[ $global == 1 ]]; then
        sync; echo 1 >/proc/sys/vm/drop_caches
        log "dropcache: flushbufs + global drop_caches"
    fi
}

cmd_status() {
    local w=$1
    echo "nbdkit pid:  $(live_pid "$w/nbdkit.pid" nbdkit || echo none)"
    echo "nbdfuse pid: $(live_pid "$w/nbdfuse.pid" nbdfuse || echo none)"
    echo "fuse mounted: $(is_mounted "$w/fuse" && echo yes || echo no)"
    echo "loop: $(sys_loops_of "$w" | tr '\n' ' ')"
    echo "ext4 mounted: $(is_mounted "$w/mnt" && echo "$w/mnt" || echo no)"
}

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[[ $# -ge 2 ]] || usage
action=$1
work=$(realpath -m "$2")
case $action in
    up) [[ $# -eq 3 ]] || usage; cmd_up "$work" "$3" ;;
    down) cmd_down "$work" ;;
    dropcache) cmd_dropcache "$work" ;;
    status) cmd_status "$work" ;;
    *) usage ;;
esac
