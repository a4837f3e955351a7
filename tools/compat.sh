#!/usr/bin/env bash
# Runs the test suite against releases CI does not pin: the newest jax and
# flax on the package index (also past the package's pins), and TensorFlow's
# nightly build. Each in a virtual environment of its own, from this
# checkout; prints the versions used and pytest's summary line for each.
#
#   tools/compat.sh [newest|tf-nightly|all] [pytest arguments...]
#
# newest      the newest jax, flax, tensorflow-cpu, optax and orbax-checkpoint
#             on the index (pip is not held to the package's pins: a release
#             past them shows here first; set FLAX_DTENSOR_SKIP_VERSION_CHECK=1
#             is passed so the suite runs rather than stopping at the check)
# tf-nightly  the package installed by its pins, then tf-nightly in place of
#             tensorflow-cpu (TF's release notes have not mentioned DTensor
#             since 2.19: this is how a TF release that breaks it is known)
# all         both (the default)
#
# Results of a run are recorded by hand on docs/compatibility.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

which=${1:-all}
[ $# -gt 0 ] && shift
case "$which" in newest|tf-nightly|all) ;; *)
  echo "usage: tools/compat.sh [newest|tf-nightly|all] [pytest arguments...]" >&2
  exit 2
esac

python_for_newest() {
  local root v p
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for v in 3.12 3.13; do
    for p in "$root"/versions/"$v".*/bin/python"$v" "$(command -v python"$v" || true)"; do
      if [ -x "$p" ]; then echo "$p"; return; fi
    done
  done
  echo "no Python 3.12 or 3.13 found (pyenv versions, PATH)" >&2
  return 1
}

versions() {
  "$1" -c 'import importlib.metadata as m, platform
def v(n):
  try:
    return m.version(n)
  except m.PackageNotFoundError:
    return None
names = ("jax", "jaxlib", "flax", "tensorflow-cpu", "tf-nightly", "optax")
print("Python", platform.python_version(), *(f"{n} {v(n)}" for n in names if v(n)))'
}

status=0
run() {  # name, then the pip install steps as one string
  local name=$1 install=$2 venv=".venv-compat-$1" python
  python=$(python_for_newest) || exit 1
  echo "== $name: $python"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q -U pip
  if ! bash -euo pipefail -c "$install"; then
    echo "== $name: the install failed"
    status=1
    return
  fi
  echo "== $name: $(versions "$venv/bin/python")"
  local log="$venv/pytest.log"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  local rc=$?
  grep -E '^(FAILED|ERROR) ' "$log" || true
  echo "== $name: $(tail -n 1 "$log") (exit $rc; the log: $log)"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$which" = newest ] || [ "$which" = all ]; then
  FLAX_DTENSOR_SKIP_VERSION_CHECK=1 run newest \
    ".venv-compat-newest/bin/pip install -q -e . --group test &&
     .venv-compat-newest/bin/pip install -q -U jax flax tensorflow-cpu optax orbax-checkpoint typer" \
    "$@"
fi
if [ "$which" = tf-nightly ] || [ "$which" = all ]; then
  run tf-nightly \
    ".venv-compat-tf-nightly/bin/pip install -q -e '.[all]' --group test &&
     .venv-compat-tf-nightly/bin/pip uninstall -q -y tensorflow-cpu &&
     .venv-compat-tf-nightly/bin/pip install -q tf-nightly" \
    "$@"
fi
exit $status
