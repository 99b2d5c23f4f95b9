# Sourced by scripts/h200_*.sh on the device: output folder, the carried wheels, the carried testdata.
set -uo pipefail
OUT=${OUT:-outputs/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
mkdir -p ../shared && ln -sfn "$PWD/.device_shared/testdata" ../shared/testdata
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
