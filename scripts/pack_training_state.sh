#!/usr/bin/env bash
# Here, before a GPU call that continues the bundled model: put its resumable state (G, G_ema, D,
# both Adam states; 717 kimg, 44 MiB) on disk and pack it for the device.
#   bash scripts/pack_training_state.sh      -> training_state/emoji64/ and .device_ckpt/emoji64-717.tar.xz
# Checkpoints are not in the tree (issue 12); this one is recovered from the commit before it left
# (3f982a7). Raw, it no longer fits a device call beside the tree (64 MiB): xz brings it to 38 MB.
# There: carry [".device_ckpt"] and run `bash scripts/h200_train.sh unpack ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${SRC:-3f982a7^}
if [ ! -f training_state/emoji64/state.json ]; then
  mkdir -p training_state
  git archive "$SRC" training_state/emoji64 | tar -x
fi
mkdir -p .device_ckpt
grep -qx "/.device_ckpt/" .gitignore || echo "/.device_ckpt/" >> .git/info/exclude
tar -C training_state --exclude=samples.png -cf - emoji64 | xz -4 -T2 > .device_ckpt/emoji64-717.tar.xz
ls -l .device_ckpt/emoji64-717.tar.xz
