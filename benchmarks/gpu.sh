#!/usr/bin/env bash
# The GPU benchmark suite on a bare H100 machine, in one go (issue 17):
#
#   bash benchmarks/gpu.sh OUTDIR [--dry_run] [the suite's options: --only NAME..., --budget_min M, --resume, ...]
#
# 1. A virtual environment with the CUDA build of the pinned jax, jax[cuda12]==$JAX_VERSION, the
#    project, and torch (CUDA build) for the side-by-side step. Machines without internet: put the
#    wheels in .whl/ at the repository root and they are installed from there alone
#    (--no-index --find-links .whl); docs/benchmarks.md says how to download them.
# 2. If the pinned jax cannot be installed (no wheels for it, no index), the environment falls
#    back to the jax and torch of the machine's own python, layered under the venv, and adds the
#    wheels that .whl/ holds (the project's missing dependencies): the suite still runs, and
#    results.json records which versions it ran on.
# 3. python -m benchmarks.gpu OUTDIR (benchmarks/gpu/): OUTDIR/results.json, OUTDIR/results.md, OUTDIR/logs/.
#
# Multi30k data: --multi30k DIR, or $MULTI30K, or the first of .data/multi30k and
# ../shared/data/multi30k that exists; without any, that case is left out.
# --dry_run: no venv and no installs; the suite's CPU dry run with $PYTHON (default python3).
#
# Environment: PYTHON (python3), VENV (/tmp/transformer_jax_gpu_venv), JAX_VERSION (0.10.2, the
# version setup.cfg's cpu, cuda12 and tpu extras pin), TORCH_VERSION (2.13.0, the [torch] extra).
set -uo pipefail

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash benchmarks/gpu.sh OUTDIR [--dry_run] [suite options]" >&2
  exit 2
fi
OUTDIR=$1
shift
cd "$(dirname "$0")/.." || exit 2  # the repository root: launch.py and .whl/ are found from here
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)

PYTHON=${PYTHON:-python3}
VENV=${VENV:-/tmp/transformer_jax_gpu_venv}
JAX_VERSION=${JAX_VERSION:-0.10.2}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

dry_run=0
has_multi30k=0
for arg in "$@"; do
  case $arg in
    --dry_run) dry_run=1 ;;
    --multi30k|--multi30k=*) has_multi30k=1 ;;
  esac
done

extra=()
if [ $has_multi30k = 0 ]; then
  for dir in "${MULTI30K:-}" .data/multi30k ../shared/data/multi30k; do
    if [ -n "$dir" ] && [ -f "$dir/train.en" ]; then
      extra=(--multi30k "$dir")
      break
    fi
  done
fi

say() { echo "gpu.sh: $*" >&2; }

# pip install from .whl/ alone when it exists, else from the index (failing fast without network).
pip_install() {
  if [ -d .whl ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index \
      --find-links .whl "$@"
  else
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --retries 1 --timeout 20 \
      "$@"
  fi
}

# The pinned jax, the project and torch in a venv of their own. Returns non-zero if jax or the
# project could not be installed; torch is optional (only the PyTorch cases need it).
install_pinned() {
  rm -rf "$VENV" && "$PYTHON" -m venv "$VENV" || return 1
  say "installing jax[cuda12]==$JAX_VERSION and the project$([ -d .whl ] && echo ' from .whl/')"
  pip_install "jax[cuda12]==$JAX_VERSION" || return 1
  pip_install -e . || return 1
  say "installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION" || pip_install torch ||
    say "warning: no torch installed; the PyTorch cases will fail"
}

# The machine's own python underneath (its jax and torch), with whatever .whl/ adds on top.
install_layered() {
  rm -rf "$VENV" && "$PYTHON" -m venv "$VENV" || return 1
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') ||
    return 1
  # site.addsitedir, not a plain path: the machine's own .pth files must be read too. A venv made
  # by a python that is itself a venv would not see that venv's packages otherwise.
  "$PYTHON" -c 'import site; [print(f"import site; site.addsitedir({d!r})")
                 for d in site.getsitepackages()]' > "$site/_machine_python.pth" || return 1
  if [ -d .whl ]; then
    say "adding the wheels in .whl/ as they are (--no-deps)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
      .whl/*.whl || say "warning: some wheels in .whl/ did not install"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --no-build-isolation -e . ||
    say "warning: the project is not installed; launch.py runs from the checkout anyway"
}

# check_environment gpu|any PYTHON: fails (non-zero) when the project's modes cannot be imported
# or (with gpu) JAX sees no GPU: the suite would then spend the GPU window measuring nothing
# useful. The dry run checks the imports too, so that a moved module fails here, not on the GPU
# machine.
check_environment() {
  BACKEND_WANTED=$1 "$2" - <<'EOF'
import importlib, os, sys
sys.path.insert(0, ".")
bad = []
# The modules of the modes the suite runs: train, evaluate, benchmark (and the torch reference).
for name in ("transformer_jax.train.loop", "transformer_jax.eval.evaluate",
             "transformer_jax.tools.benchmark", "transformer_jax.tools.torch_reference"):
  try:
    importlib.import_module(name)
  except Exception as e:  # pylint: disable=broad-except
    bad.append(f"{name}: {type(e).__name__}: {e}")
import jax
print(f"gpu.sh: jax {jax.__version__} on {jax.default_backend()}: {jax.devices()}", file=sys.stderr)
if os.environ["BACKEND_WANTED"] == "gpu" and jax.default_backend() != "gpu":
  bad.append(f"jax runs on {jax.default_backend()}, not a GPU")
try:
  import torch
  print(f"gpu.sh: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}",
        file=sys.stderr)
except Exception as e:  # pylint: disable=broad-except
  print(f"gpu.sh: warning: no torch ({e}); the PyTorch cases will fail", file=sys.stderr)
for line in bad:
  print(f"gpu.sh: error: {line}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
}

if [ $dry_run = 1 ]; then
  suite_python=$PYTHON
  check_environment any "$PYTHON" || { say "error: the project's modes do not import"; exit 3; }
else
  if [ -f "$VENV/.ready" ]; then
    say "reusing $VENV ($(cat "$VENV/.ready"))"
  else
    started=$SECONDS
    if install_pinned 2>>"$OUTDIR/install.log"; then
      echo "pinned jax[cuda12]==$JAX_VERSION" > "$VENV/.ready"
    else
      say "could not install jax[cuda12]==$JAX_VERSION (see $OUTDIR/install.log); falling back" \
          "to the jax and torch of $PYTHON"
      install_layered 2>>"$OUTDIR/install.log" || { say "error: no environment"; exit 3; }
      echo "layered over $PYTHON" > "$VENV/.ready"
    fi
    say "environment ready in $((SECONDS - started)) s"
  fi
  "$VENV/bin/python" -m pip freeze > "$OUTDIR/pip_freeze.txt" 2>/dev/null
  if ! check_environment gpu "$VENV/bin/python"; then
    say "error: not running the suite (set GPU_SH_FORCE=1 to run it anyway)"
    [ "${GPU_SH_FORCE:-0}" = 1 ] || exit 3
  fi
  suite_python=$VENV/bin/python
fi

exec "$suite_python" -m benchmarks.gpu "$OUTDIR" ${extra[@]+"${extra[@]}"} "$@"
