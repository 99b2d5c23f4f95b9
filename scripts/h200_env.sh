# Sourced by scripts/h200_*.sh on the device: output folder, the carried wheels, the carried testdata.
set -uo pipefail
OUT=${OUT:-outputs/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Training needs no wheels: install them only when a call carried some, with their bytecode as a user's pip
# install has it (the machine sets PYTHONDONTWRITEBYTECODE; measured 2026-12-05: no difference to the import time).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
[ -d .device_shared/testdata ] && mkdir -p ../shared && ln -sfn "$PWD/.device_shared/testdata" ../shared/testdata
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
