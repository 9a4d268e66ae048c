#!/usr/bin/env bash
# Wheels of otbflow's dependencies for an offline GPU machine whose Python 3.12 already has torch,
# transformers and the rest of the image's list below (the lent H100/H200 machines' 'cuda' image),
# at the versions of this checkout's .venv (run `make setup` first), from the checkout's root:
#   bash benchmarks/gpu/bundle.sh .gpu-bundle     # OUTDIR/part1: polars' runtime (~52 MB) alone; part2: the rest (~15 MB)
#   bash benchmarks/gpu/bundle.sh --list          # the packages it would fetch, one a line; fetches nothing
# part2 holds snakemake and its plugins' interfaces, deepspeed (built here as a pure-Python wheel, by
# the venv's Python: its setup imports torch, and a bare interpreter's setuptools may lack bdist_wheel),
# omegaconf, polars, math-verify, submitit, ... PuLP is left out (16 MB: Snakemake falls back to its
# greedy scheduler), and so are the dev tools, wandb and the CUDA libraries. The two parts fit a
# transfer limit of 64 MB each; benchmarks/gpu/check.sh --bundle OUTDIR installs them (docs/environments.md,
# "The GPU check"). Adapted from ../shared/gpu/bundle.sh.
set -eu
cd "$(dirname "$0")/../.."
out=${1:?usage: bundle.sh OUTDIR | --list}
skip='^(torch|transformers|accelerate|pyarrow|numpy|matplotlib|tensorboard|pyyaml|jinja2|otbflow|ruff|snakefmt|black|pytokens|shfmt-py|wandb|pulp|pytest.*|filelock|sentry-sdk|nvidia-.*|triton|.*opentelemetry.*|httpx2|httpcore2|truststore|googleapis-common-protos|cwevals|sniffio|distro)=='
# packages the GPU image ships (lower case, '-' for '_'): not bundled
present=" absl-py accelerate aiofiles aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click
cloudpickle cmake colorama contourpy coverage cycler cython einops filelock fonttools frozenlist fsspec h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna iniconfig jinja2 joblib kiwisolver markdown markdown-it-py
markupsafe matplotlib mdurl mpmath msgpack multidict networkx ninja numpy packaging pandas pathspec pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pygments pyparsing python-dateutil pyyaml regex requests
rich safetensors scipy sentencepiece setuptools shellingham six sortedcontainers sympy tabulate tensorboard
tensorboard-data-server threadpoolctl tiktoken tokenizers toolz torch tqdm transformers typer typing-extensions
urllib3 werkzeug wheel wrapt xxhash yarl zipp py-cpuinfo nvidia-ml-py grpcio execnet
mypy-extensions typing-inspect pytest pytest-xdist pytest-timeout "
present=$(echo $present | tr '\n' ' ')
pkgs=()
while IFS= read -r line; do
  name=${line%%==*} && low=$(echo "$name" | tr 'A-Z_' 'a-z-')
  [[ " $present " == *" $low "* ]] && continue
  echo "$line" | grep -qiE "$skip" && continue
  pkgs+=("$line")
done < <(.venv/bin/python -m pip list --format=freeze --disable-pip-version-check 2> /dev/null | grep '==')
if [[ $out == --list ]]; then
  printf '%s\n' "${pkgs[@]}"
  exit 0
fi
mkdir -p "$out/part1" "$out/part2"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/part2" "$p" > /dev/null 2>&1 \
    || .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$out/part2" "$p" > /dev/null 2>&1 \
    || echo "no wheel for $p" >&2
done
mv "$out"/part2/polars_runtime*.whl "$out/part1/" 2> /dev/null || true
du -sh "$out/part1" "$out/part2"
