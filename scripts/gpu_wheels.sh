#!/usr/bin/env bash
# Wheels the GPU machines need for the optional e2e columns (they reach no package registry): downloads them into
# .whl/ (git-ignored; never commit it) for CPython 3.12 on x86-64, trimmed to fit the device tool's 64 MiB carry.
#
#   bash scripts/gpu_wheels.sh            # then, on the GPU machine (carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
#
# - liger-kernel: the "liger" columns; flash-linear-attention + fla-core: the "fla" columns (Qwen3.5);
# - unsloth + unsloth_zoo (2026.10.9: the first pair whose caps admit transformers 5.17), trl 1.15.0 (unsloth's cap),
#   datasets 4.8.5 with dill and multiprocess, and the pure-python modules they import at import time that the GPU
#   image lacks: the "unsloth" column (fastft/e2e/unsloth.py). The unsloth wheel is rebuilt without its studio/
#   folder (a web application: 26 of its 28.6 MB), and its RECORD without those files;
# - bitsandbytes (QLoRA, --quant nf4; unsloth imports it when present) with only the CUDA libraries named in
#   BNB_CUDA (default "130 132": the GPU's torch 2.11 is built for CUDA 13.0) and the CPU one: the wheel ships one
#   library per CUDA and ROCm version, 43 MB in all.
# Everything else unsloth needs (pandas, pyarrow, xxhash, fsspec, httpx, psutil, protobuf, sentencepiece, pillow,
# rich, typer, triton, peft, accelerate, ...) is in the GPU image already (.library's KINDS.md package list).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
BNB_CUDA=${BNB_CUDA:-130 132}
mkdir -p "$DEST"

download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$DEST" "$@" 2>&1 | grep -v "is ignored" || true
}

download liger-kernel==0.8.5
download flash-linear-attention==0.6.0 fla-core==0.6.0  # the "stock sdpa, fla" columns of hybrid models
download unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
# import-time needs of unsloth / unsloth_zoo / trl that the GPU image lacks (pure python)
download tyro==1.0.17 docstring-parser==0.17.0 typeguard==4.4.4 msgspec==0.19.0 cut_cross_entropy==25.1.1 \
    hf_transfer==0.1.9 torchao==0.18.0
download bitsandbytes==0.50.2

# trim WHEEL REGEX: rewrite WHEEL without the members whose path matches REGEX, and without their RECORD lines
trim() {
    python3 - "$1" "$2" <<'EOF'
import os, re, sys, zipfile

path, pattern = sys.argv[1], re.compile(sys.argv[2])
with zipfile.ZipFile(path) as src:
    names = src.namelist()
    dropped = {n for n in names if pattern.search(n)}
    if not dropped:
        print(f"{os.path.basename(path)}: already trimmed")
        sys.exit(0)
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in dropped).encode()
            out.writestr(info, data)
os.replace(tmp, path)
print(f"{os.path.basename(path)}: dropped {len(dropped)} files")
EOF
}

trim "$(ls "$DEST"/unsloth-2026.10.9-*.whl)" '^studio/'
keep=$(printf '%s|' $BNB_CUDA)
trim "$(ls "$DEST"/bitsandbytes-0.50.2-*.whl)" "^bitsandbytes/libbitsandbytes_(?!cpu\.so|cuda(${keep%|})\.so)"

ls -l "$DEST"
echo "total: $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes (the device tool carries 64 MiB = 67108864 with the tree)"
