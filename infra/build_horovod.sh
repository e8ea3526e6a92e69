#!/usr/bin/env bash
# shellcheck disable=SC2317  # cleanup/on_signal/import_check run via trap/step
# Build (or reuse from cache) a Horovod wheel for the torch installed in a venv.
#
# Usage: infra/build_horovod.sh PYTHON
#
#   PYTHON  path to a venv's python that already has torch installed
#           (torch==2.13.0 CPU for Alnair).
#
# The LAST (and only) line on stdout is the absolute path of a directory that
# holds exactly one horovod-<version>-*.whl, so a caller can run:
#
#   dir="$(infra/build_horovod.sh .venv/bin/python | tail -n1)"
#   .venv/bin/python -m pip install --find-links "$dir" horovod==0.28.1
#
# Everything else (progress, errors) goes to stderr; the full build log is kept
# in the cache (next to the wheel on success, as failed-<key>.log on failure).
#
# Why this exists: Horovod 0.28.1 is the last release, ships only an sdist, and
# does not build against torch >= 2.1 as released because its CMake files pin
# C++14 (horovod/horovod#3996, #4014). We patch both CMakeLists to C++17 and
# build without build isolation so the build sees the venv's torch (isolation
# would pull a multi-GB CUDA torch from the index).
#
# Cache: ${ALNAIR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/alnair}/horovod/<key>/
#   <key> = short sha256 over: horovod version + sdist hash, torch version and
#   ABI (asked from PYTHON), Python version/SOABI, platform + libc, C/C++
#   compiler identity, build flags, and the content of this script (and of any
#   file under infra/horovod/, should patches ever live there).
#   A miss builds in a temp dir inside the cache and publishes with one `mv`,
#   under a per-key flock, so interrupted or concurrent runs never leave a
#   half-written entry.
#
# Environment knobs (none affect the wheel's content):
#   ALNAIR_CACHE_DIR        cache root (default: $XDG_CACHE_HOME/alnair)
#   ALNAIR_BUILD_JOBS       parallel compile jobs (default: CPU count, max 8)
#   ALNAIR_VERBOSE=1 / CI=true   stream the build log to stderr as it runs
#   CC / CXX                compilers to use (default: cc / c++ on PATH)

set -euo pipefail

HOROVOD_VERSION=0.28.1
# sha256 of horovod-0.28.1.tar.gz as published on PyPI.
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# Build-time Python deps needed without build isolation (setup.py imports
# horovod/__init__, which pulls the runner; setup_requires lists the rest).
# Lower bounds only, so an already-satisfied venv is left untouched. Never torch.
BUILD_DEPS=("setuptools>=64" "wheel" "packaging" "cloudpickle" "psutil" "pyyaml" "cffi>=1.4.0")
MIN_CMAKE_VERSION=3.13
PIP_CMAKE_SPEC="cmake>=3.18,<5"
# Portable CPU flags: without this, Horovod probes `gcc -march=native` and
# bakes -mavx/-mf16c/-mfma into the wheel, which would make a shared cache
# entry host-specific. (Must be non-empty: empty means "probe".)
HOROVOD_ARCH_FLAGS="-mtune=generic"

# All stdout goes to stderr; fd 3 is the real stdout, used once at the end.
exec 3>&1 1>&2

log() { printf '[build_horovod] %s\n' "$*" >&2; }
die() {
    printf '[build_horovod] ERROR: %s\n' "$*" >&2
    exit 1
}

[[ $# -eq 1 ]] || die "usage: $0 PYTHON   (path to a venv python with torch installed)"

# --- the interpreter --------------------------------------------------------
PYTHON="$1"
if [[ "$PYTHON" != */* ]]; then
    PYTHON="$(command -v -- "$PYTHON" || true)"
    [[ -n "$PYTHON" ]] || die "'$1' not found on PATH"
fi
# Make absolute without resolving symlinks (a venv's python is a symlink to
# the base interpreter; resolving it would escape the venv).
[[ "$PYTHON" == /* ]] || PYTHON="$PWD/$PYTHON"
[[ -x "$PYTHON" && ! -d "$PYTHON" ]] || die "PYTHON '$PYTHON' is not an executable file"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)' \
    || die "PYTHON '$PYTHON' does not run or is older than Python 3.8"

SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
PATCH_DIR="$(dirname "$SCRIPT_PATH")/horovod"

# One probe for every interpreter-side cache-key input.
probe_out="$("$PYTHON" - "$SCRIPT_PATH" "$PATCH_DIR" <<'PY'
import hashlib, os, platform, sys, sysconfig, warnings
warnings.simplefilter("ignore")
script, patch_dir = sys.argv[1], sys.argv[2]
print("python=%d.%d" % sys.version_info[:2])
print("python_tag=" + sys.implementation.cache_tag)
print("soabi=" + str(sysconfig.get_config_var("SOABI")))
print("platform=" + sysconfig.get_platform())
print("libc=" + "-".join(platform.libc_ver()))
h = hashlib.sha256()
files = [script]
if os.path.isdir(patch_dir):
    for root, _, names in os.walk(patch_dir):
        files += [os.path.join(root, n) for n in names]
for f in sorted(files):
    h.update(os.path.relpath(f, os.path.dirname(script)).encode() + b"\0")
    with open(f, "rb") as fh:
        h.update(fh.read() + b"\0")
print("script_sha256=" + h.hexdigest())
try:
    import torch
except Exception as e:  # report, do not crash: the shell turns it into a clear error
    print("torch_error=%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
    sys.exit(0)
print("torch=" + torch.__version__)
print("torch_cxx11_abi=" + str(torch.compiled_with_cxx11_abi()))
print("torch_cuda=" + str(torch.version.cuda))
PY
)" || die "could not probe PYTHON '$PYTHON' (see the Python error above)"

if grep -q '^torch_error=' <<<"$probe_out"; then
    die "torch is not importable by '$PYTHON' ($(sed -n 's/^torch_error=//p' <<<"$probe_out")). Install it first, e.g. '$PYTHON -m pip install torch==2.13.0' (the pinned CPU wheel; never an unpinned torch)."
fi
TORCH_VERSION="$(sed -n 's/^torch=//p' <<<"$probe_out")"
[[ "$TORCH_VERSION" == 2.13.* ]] \
    || log "warning: PYTHON has torch $TORCH_VERSION, Alnair pins 2.13.0; building for it anyway (it is part of the cache key)"

# --- toolchain --------------------------------------------------------------
# The venv's bin dir goes first so a pip-installed cmake is found.
PATH="$(dirname "$PYTHON"):$PATH"
export PATH

pick_tool() { # pick_tool ENV_VALUE CANDIDATE... -> first that resolves
    local c
    for c in "$@"; do
        [[ -n "$c" ]] || continue
        if command -v -- "${c%% *}" >/dev/null 2>&1; then
            printf '%s\n' "$c"
            return 0
        fi
    done
    return 1
}
if [[ -n "${CXX:-}" ]]; then
    command -v -- "${CXX%% *}" >/dev/null 2>&1 || die "CXX='$CXX' is set but '${CXX%% *}' is not found"
fi
if [[ -n "${CC:-}" ]]; then
    command -v -- "${CC%% *}" >/dev/null 2>&1 || die "CC='$CC' is set but '${CC%% *}' is not found"
fi
CXX_BIN="$(pick_tool "${CXX:-}" c++ g++ clang++)" \
    || die "no C++ compiler found (tried \$CXX, c++, g++, clang++). Install one, e.g. 'apt-get install g++' / build-essential."
CC_BIN="$(pick_tool "${CC:-}" cc gcc clang)" \
    || die "no C compiler found (tried \$CC, cc, gcc, clang); Gloo needs one. Install e.g. 'apt-get install gcc'."
command -v make >/dev/null 2>&1 || die "'make' not found; CMake's default generator needs it (apt-get install make)."
CXX_ID="$($CXX_BIN --version 2>/dev/null | sed -n 1p)" || true
CC_ID="$($CC_BIN --version 2>/dev/null | sed -n 1p)" || true
[[ -n "$CXX_ID" ]] || die "C++ compiler '$CXX_BIN' does not run ('$CXX_BIN --version' failed)"
[[ -n "$CC_ID" ]] || die "C compiler '$CC_BIN' does not run ('$CC_BIN --version' failed)"

# --- cache key --------------------------------------------------------------
KEY_INPUTS="$(
    printf 'horovod=%s\nhorovod_sdist_sha256=%s\n' "$HOROVOD_VERSION" "$HOROVOD_SDIST_SHA256"
    printf '%s\n' "$probe_out"
    printf 'cxx=%s\ncc=%s\narch_flags=%s\n' "$CXX_ID" "$CC_ID" "$HOROVOD_ARCH_FLAGS"
    printf 'features=pytorch,gloo;no-mpi,no-tensorflow,no-mxnet,no-nvtx;c++17\n'
    # Compiler flags from the environment reach CMake and change the binary.
    for v in CPPFLAGS CFLAGS CXXFLAGS LDFLAGS; do
        [[ -z "${!v:-}" ]] || printf '%s=%s\n' "$v" "${!v}"
    done
)"
KEY="$(printf '%s\n' "$KEY_INPUTS" | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"

CACHE_ROOT="${ALNAIR_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:?HOME is unset; set ALNAIR_CACHE_DIR}/.cache}/alnair}"
mkdir -p "$CACHE_ROOT/horovod" || die "cannot create cache dir '$CACHE_ROOT/horovod'"
HVD_CACHE="$(cd "$CACHE_ROOT/horovod" && pwd)"
FINAL="$HVD_CACHE/$KEY"

entry_ok() { # exactly one matching wheel in the dir
    local d="$1" n=0 f
    [[ -d "$d" ]] || return 1
    for f in "$d"/horovod-"$HOROVOD_VERSION"-*.whl; do
        [[ -f "$f" ]] && n=$((n + 1))
    done
    [[ $n -eq 1 ]]
}

emit() { # the one line on stdout
    printf '%s\n' "$FINAL" >&3
    exit 0
}

if entry_ok "$FINAL"; then
    log "cache hit: $FINAL"
    emit
fi

# --- miss: serialize builders of this key -----------------------------------
LOCK="$HVD_CACHE/.$KEY.lock"
HAVE_LOCK=0
if command -v flock >/dev/null 2>&1; then
    exec 9>"$LOCK"
    if ! flock -n 9; then
        log "another build of $KEY is running; waiting for its lock ($LOCK)"
        flock 9
    fi
    HAVE_LOCK=1
    if entry_ok "$FINAL"; then # built by whoever held the lock
        log "cache hit (built concurrently): $FINAL"
        emit
    fi
else
    log "warning: 'flock' not available; concurrent builds of the same key will duplicate work (the publish is still atomic)"
fi

log "cache miss for key $KEY; building Horovod $HOROVOD_VERSION against torch $TORCH_VERSION (takes ~10 min on 2 cores)"
while IFS= read -r line; do log "  key input: $line"; done <<<"$KEY_INPUTS"

if [[ $HAVE_LOCK -eq 1 ]]; then
    # We own this key: leftovers from killed runs can go.
    rm -rf "$HVD_CACHE/.tmp.$KEY."*
fi
TMP="$(mktemp -d "$HVD_CACHE/.tmp.$KEY.XXXXXX")"
BUILD_LOG="$TMP/build.log"
FAILED_LOG="$HVD_CACHE/failed-$KEY.log"
HEARTBEAT_PID=""

CHILD_PID=""

cleanup() {
    local rc=$?
    if [[ -n "$HEARTBEAT_PID" ]]; then
        kill "$HEARTBEAT_PID" 2>/dev/null || true
        wait "$HEARTBEAT_PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
    exit "$rc"
}
# A signal stops the whole build (pip, cmake, make, compilers run in their own
# process group), waits for it so nothing writes into $TMP, then cleans up.
on_signal() {
    log "interrupted; stopping the build and removing $TMP"
    if [[ -n "$CHILD_PID" ]]; then
        kill -TERM -- "-$CHILD_PID" 2>/dev/null || kill -TERM "$CHILD_PID" 2>/dev/null || true
        wait "$CHILD_PID" 2>/dev/null || true
    fi
    exit "$1"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP

VERBOSE=0
if [[ "${ALNAIR_VERBOSE:-0}" == 1 || "${CI:-}" == true ]]; then VERBOSE=1; fi

# step "description" cmd...  -- run with output to the build log; on failure
# keep the log in the cache, show the errors and the tail, and name the step.
step() {
    local desc="$1" start=$SECONDS rc=0
    shift
    log "$desc"
    printf '\n===== %s\n===== $ %s\n' "$desc" "$*" >>"$BUILD_LOG"
    if [[ $VERBOSE -eq 0 ]]; then
        ( # heartbeat so long steps are visibly alive (and CI does not idle-kill us)
            exec 3>&- 9>&-
            sp=""
            trap 'kill $sp 2>/dev/null; exit 0' TERM
            while :; do
                sleep 60 &
                sp=$!
                wait "$sp"
                log "  ... still running ($((SECONDS - start))s): $(tail -n 1 "$BUILD_LOG" 2>/dev/null | cut -c1-150)"
            done
        ) &
        HEARTBEAT_PID=$!
    fi
    # Run in the background in its own process group (set -m) so signals can
    # reach the whole tree and `wait` lets our traps run immediately.
    set -m
    if [[ $VERBOSE -eq 1 ]]; then
        { "$@" 2>&1 | tee -a "$BUILD_LOG" >&2; } </dev/null 3>&- 9>&- &
    else
        "$@" </dev/null >>"$BUILD_LOG" 2>&1 3>&- 9>&- &
    fi
    CHILD_PID=$!
    set +m
    wait "$CHILD_PID" || rc=$?
    CHILD_PID=""
    if [[ -n "$HEARTBEAT_PID" ]]; then
        kill "$HEARTBEAT_PID" 2>/dev/null || true
        wait "$HEARTBEAT_PID" 2>/dev/null || true
        HEARTBEAT_PID=""
    fi
    if [[ $rc -ne 0 ]]; then
        cp -f "$BUILD_LOG" "$FAILED_LOG" 2>/dev/null || true
        log "----- first error lines in the build log -----"
        grep -n -E 'CMake Error|[Ee]rror:|fatal error|\*\*\* \[|CalledProcessError|No such file' "$BUILD_LOG" \
            | grep -v -E 'Can not execute|except ImportError|clear error message' | head -n 25 >&2 || true
        log "----- last 40 lines of the build log -----"
        tail -n 40 "$BUILD_LOG" >&2 || true
        log "------------------------------------------"
        die "step failed (exit $rc): $desc. Full log: $FAILED_LOG"
    fi
    log "  done in $((SECONDS - start))s"
}

sha256_of() { "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"; }

BUILD_START=$SECONDS
printf 'Horovod build for key %s\n%s\n' "$KEY" "$KEY_INPUTS" >"$BUILD_LOG"

# 1. Build-time deps into PYTHON (lower bounds only; never torch).
step "installing build deps into $PYTHON: ${BUILD_DEPS[*]}" \
    "$PYTHON" -m pip install --disable-pip-version-check --progress-bar off "${BUILD_DEPS[@]}"

# 2. cmake >= 3.13: prefer one on PATH, else install the PyPI one into the venv.
cmake_ok() {
    local v
    v="$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p')" || return 1
    [[ -n "$v" ]] || return 1
    "$PYTHON" -c 'import sys; from packaging.version import Version as V; sys.exit(0 if V(sys.argv[1]) >= V(sys.argv[2]) else 1)' "$v" "$MIN_CMAKE_VERSION"
}
if ! cmake_ok; then
    step "no cmake >= $MIN_CMAKE_VERSION on PATH; installing '$PIP_CMAKE_SPEC' into $PYTHON" \
        "$PYTHON" -m pip install --disable-pip-version-check --progress-bar off "$PIP_CMAKE_SPEC"
    hash -r
    cmake_ok || die "cmake >= $MIN_CMAKE_VERSION still not usable after installing it into $(dirname "$PYTHON")"
fi
log "using $(command -v cmake) ($(cmake --version | sed -n 1p)), CXX=$CXX_BIN, CC=$CC_BIN"

# Installing deps must not have changed torch (it would invalidate the key).
now_torch="$("$PYTHON" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
[[ "$now_torch" == "$TORCH_VERSION" ]] \
    || die "torch in $PYTHON changed from '$TORCH_VERSION' to '$now_torch' while installing build deps; aborting"

# 3. The sdist (cached across keys, verified by sha256).
SDIST_DIR="$HVD_CACHE/sdist"
SDIST="$SDIST_DIR/horovod-$HOROVOD_VERSION.tar.gz"
if [[ ! -f "$SDIST" || "$(sha256_of "$SDIST")" != "$HOROVOD_SDIST_SHA256" ]]; then
    mkdir -p "$TMP/dl" "$SDIST_DIR"
    step "downloading horovod==$HOROVOD_VERSION sdist" \
        "$PYTHON" -m pip download --disable-pip-version-check --progress-bar off \
        --no-deps --no-binary :all: --no-build-isolation -d "$TMP/dl" "horovod==$HOROVOD_VERSION"
    [[ -f "$TMP/dl/horovod-$HOROVOD_VERSION.tar.gz" ]] \
        || die "pip download did not produce horovod-$HOROVOD_VERSION.tar.gz (got: $(ls "$TMP/dl"))"
    got="$(sha256_of "$TMP/dl/horovod-$HOROVOD_VERSION.tar.gz")"
    [[ "$got" == "$HOROVOD_SDIST_SHA256" ]] \
        || die "sha256 mismatch for horovod-$HOROVOD_VERSION.tar.gz: got $got, expected $HOROVOD_SDIST_SHA256"
    mv -f "$TMP/dl/horovod-$HOROVOD_VERSION.tar.gz" "$SDIST"
fi

# 4. Unpack and patch C++14 -> C++17 (torch >= 2.1 headers need C++17).
mkdir -p "$TMP/src"
tar -xzf "$SDIST" -C "$TMP/src" || die "cannot unpack $SDIST"
SRC="$TMP/src/horovod-$HOROVOD_VERSION"
PATCH_PY='
import pathlib, sys
src = pathlib.Path(sys.argv[1])
old, new = "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"
for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
    p = src / rel
    text = p.read_text()
    n = text.count(old)
    if n != 1:
        sys.exit("%s: expected exactly one %r, found %d" % (rel, old, n))
    p.write_text(text.replace(old, new))
    print("patched", rel)
'
step "patching CMakeLists.txt and horovod/torch/CMakeLists.txt to C++17" \
    "$PYTHON" -c "$PATCH_PY" "$SRC"
if [[ -d "$PATCH_DIR" ]]; then
    for p in "$PATCH_DIR"/*.patch; do
        [[ -f "$p" ]] || continue
        command -v patch >/dev/null 2>&1 || die "'patch' is needed to apply $p"
        step "applying $(basename "$p")" patch -d "$SRC" -p1 --forward --batch -i "$p"
    done
fi

# 5. Build the wheel against the venv's torch.
JOBS="${ALNAIR_BUILD_JOBS:-$("$PYTHON" -c 'import os; print(max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))))')}"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "ALNAIR_BUILD_JOBS must be a positive integer, got '$JOBS'"
# Drop any inherited HOROVOD_* settings (HOROVOD_GPU_OPERATIONS, HOROVOD_DEBUG,
# HOROVOD_LOCAL_VERSION, ...): they would change the wheel but are not in the key.
while IFS= read -r v; do unset "$v"; done < <(compgen -e | grep '^HOROVOD_' || true)
# A parent `make -jN` exports MAKEFLAGS (jobserver fds etc.); pin ours instead.
unset MFLAGS MAKEFLAGS GNUMAKEFLAGS
mkdir -p "$TMP/out"
step "building the wheel (pip wheel, -j$JOBS; log: $FAILED_LOG on failure)" \
    env \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_NVTX=1 \
    HOROVOD_BUILD_ARCH_FLAGS="$HOROVOD_ARCH_FLAGS" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    MAKEFLAGS="-j$JOBS" \
    CC="$CC_BIN" CXX="$CXX_BIN" \
    "$PYTHON" -m pip wheel -v --disable-pip-version-check --progress-bar off \
    --no-deps --no-build-isolation --use-pep517 -w "$TMP/out" "$SRC"

entry_ok "$TMP/out" || die "pip wheel finished but $TMP/out does not hold exactly one horovod-$HOROVOD_VERSION-*.whl: $(ls "$TMP/out")"
WHEEL="$(ls "$TMP/out/horovod-$HOROVOD_VERSION"-*.whl)"

# 6. Check the wheel before publishing: torch extension present, importable
#    with this torch, Gloo compiled in.
mkdir -p "$TMP/check"
step "smoke-testing $(basename "$WHEEL")" \
    "$PYTHON" -m pip install --disable-pip-version-check --progress-bar off --no-deps --target "$TMP/check" "$WHEEL"
import_check() { # run outside the source tree so `import horovod` is the wheel's
    (cd "$TMP" && PYTHONPATH="$TMP/check" "$PYTHON" -W ignore -c '
import sys, horovod, horovod.torch as hvd
assert horovod.__file__.startswith(sys.argv[1]), horovod.__file__
assert hvd.gloo_built(), "Gloo not compiled in"
print("horovod", horovod.__version__, "imports with this torch; gloo_built", hvd.gloo_built(), "mpi_built", hvd.mpi_built())
' "$TMP/check")
}
step "importing horovod.torch from the built wheel" import_check

# 7. Publish atomically.
BUILD_SECONDS=$((SECONDS - BUILD_START))
{
    printf 'key=%s\nbuilt=%s\nbuild_seconds=%s\nwheel=%s\n' \
        "$KEY" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$BUILD_SECONDS" "$(basename "$WHEEL")"
    printf '%s\n' "$KEY_INPUTS"
} >"$TMP/out/build-info.txt"
cp "$BUILD_LOG" "$TMP/out/build.log"
if [[ -e "$FINAL" ]]; then # broken entry (e.g. emptied by hand): swap it out
    mv "$FINAL" "$TMP/stale-entry"
fi
mv "$TMP/out" "$FINAL"
rm -f "$FAILED_LOG"
log "built $(basename "$WHEEL") in ${BUILD_SECONDS}s -> $FINAL"
emit
