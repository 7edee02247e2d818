# Sourced by the GPU scripts: installs the ferrocore wheel built elsewhere (`maturin build
# --release -o .wheels`) and any carried wheels (.whl: pytest, expecttest) into a private
# directory on PYTHONPATH, and prints what runs. Sets PY and SITE; returns 2 when nothing can run.
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/ferrocore-site}"
mkdir -p "$OUT"
wheels=("${WHEELS:-.wheels}"/ferrocore-*.whl)
[ -e "${wheels[0]}" ] || { echo "no ferrocore wheel in ${WHEELS:-.wheels}" >&2; return 2; }
extra=()
for w in "${TEST_WHEELS:-.whl}"/*.whl; do [ -e "$w" ] && extra+=("$w"); done
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}" "${extra[@]}" || return 2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF' || return 2
import torch, triton, ferrocore
print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, ferrocore {ferrocore.__file__}")
PYEOF
