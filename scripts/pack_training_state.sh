#!/usr/bin/env bash
# Here, before a GPU call that continues the bundled model: put a resumable state (G, G_ema, D, both
# Adam states; 44 MiB for emoji64) in training_state/emoji64/ and pack it for the device.
#   bash scripts/pack_training_state.sh                 -> training_state/emoji64 as it is, or (when absent)
#                                                          the 717-kimg state from git history
#   FROM=/work/.device/N bash scripts/pack_training_state.sh
#                                                       -> a checkpoint a `WAIT_CKPT=1 ... wait` call brought back
# Both write .device_ckpt/emoji64.tar.xz (xz: ~38 MB; raw, 44 MiB does not fit a device call beside
# the tree's 21 MB). Checkpoints are not in the tree (issue 12): the 717-kimg one is recovered from
# the commit before it left (3f982a7). There: carry [".device_ckpt"] and run `bash scripts/h200_train.sh unpack ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${SRC:-3f982a7^}
DST=training_state/emoji64
if [ -n "${FROM:-}" ]; then
  [ -f "$FROM/state.json" ] || { echo "error: $FROM has no state.json (bring it back with WAIT_CKPT=1)" >&2; exit 2; }
  rm -rf "$DST.new" && mkdir -p "$DST.new"
  cp "$FROM"/state.json "$FROM"/*.safetensors "$DST.new/"
  [ -f "$FROM/log.jsonl" ] && cp "$FROM/log.jsonl" "$DST.new/"
  chmod -R u+w "$DST.new"
  # the files must be the ones state.json lists (sizes and SHA-256), or the device would resume from a mix
  .venv/bin/python -c "from training import checkpoint as c; import sys; d = c.read_state(sys.argv[1]); c.verify(sys.argv[1], d); print('checkpoint verified:', d['kimg'], 'kimg')" "$DST.new" \
    || { rm -rf "$DST.new"; exit 2; }
  rm -rf "$DST" && mv "$DST.new" "$DST"
elif [ ! -f "$DST/state.json" ]; then
  mkdir -p training_state
  git archive "$SRC" "$DST" | tar -x
fi
mkdir -p .device_ckpt
grep -qx "/.device_ckpt/" .gitignore || grep -qx "/.device_ckpt/" .git/info/exclude 2>/dev/null || echo "/.device_ckpt/" >> .git/info/exclude
rm -f .device_ckpt/*.tar.xz
tar -C training_state --exclude=samples.png -cf - emoji64 | xz -4 -T2 > .device_ckpt/emoji64.tar.xz
ls -l .device_ckpt/emoji64.tar.xz
