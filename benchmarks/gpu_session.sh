#!/usr/bin/env bash
# The GPU measurements as one command, for a GPU machine lent for a few minutes (one call, nothing to set up there).
#
#   bash benchmarks/gpu_session.sh [OUT]          # from the repository root; OUT defaults to $OUT, else a temp folder
#
# 1. Installs the wheels in .whl/ when there are any (benchmarks/gpu_wheels.py fetches them where an index is
#    reachable: a GPU machine's Python often lacks vitlab's dependencies) into /tmp/site, and puts their programs
#    (py-spy) on PATH.
# 2. Runs the CUDA-only tests (the checkpoint writer's pinned buffers, device normalisation, classification's and
#    SwinUNETR's steps under torch.cuda.set_sync_debug_mode("error"), a fit replayed as CUDA graphs) into cudatests.txt, then
#    `bench_gpu.py` (the default runs, then `graphsonly` and `cudagraphs` for both, `nocallbacks`, and `compile` for
#    both, as far as its time limit goes: each run's figures are kept as it ends), then, with GPU_SESSION_LADDER=1,
#    `bench_gpu_ladder.py --py-spy` (its first rungs, within its time limit), each under its own time limit, with
#    their data, runs and py-spy files in a temp folder, not in OUT: the data are thousands of files, and a machine
#    lent for minutes may return only a few files. The defaults fit one 600 s call; the ladder takes a second one.
# 3. Leaves in OUT at most six files: cudatests.txt, bench_gpu.txt and ladder.txt (what each printed),
#    bench_gpu.json, and results.tar.gz (the JSON, torch.profiler's tables, py-spy's samples of the default runs'
#    first epochs, the ladder's py-spy stacks and lock-holder samples).
#
# Without a GPU each benchmark says so in one line (and the CUDA tests are skipped). Environment (defaults in
# brackets): GPU_SESSION_SMOKE=1 runs the benchmarks with --smoke (tiny models on the CPU: checks this script);
# GPU_SESSION_TESTS [1] (0: no tests), TESTS_S [150]; BENCH_GPU_ARGS [--task vit swinunetr --variants graphsonly
# cudagraphs nocallbacks compile], BENCH_GPU_S [400]; GPU_SESSION_LADDER [0], LADDER_S [230] (seconds); PYTHON [python3].
set -u
out=${1:-${OUT:-$(mktemp -d -t vitlab-gpu-session-XXXXXX)}}
mkdir -p "$out"
work=$(mktemp -d -t vitlab-gpu-work-XXXXXX)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_session: the wheels in .whl/ did not install" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
smoke=()
[ "${GPU_SESSION_SMOKE:-0}" = 1 ] && smoke=(--smoke)
read -r -a bench_args <<< "${BENCH_GPU_ARGS:---task vit swinunetr --variants graphsonly cudagraphs nocallbacks compile}"

if [ "${GPU_SESSION_TESTS:-1}" != 0 ]; then
    {
        timeout "${TESTS_S:-150}" "$python" -m pytest -q -p no:cacheprovider -k "cuda or pinned" tests/test_checkpoint_writer.py \
            tests/data/test_device_normalize.py tests/training/test_step_syncs.py \
            tests/training/test_compile.py tests/test_runtime.py 2>&1 | tail -25
        echo "gpu_session: CUDA tests exit status ${PIPESTATUS[0]}"
    } 2>&1 | tee "$out/cudatests.txt"
fi
{
    echo "gpu_session: $(date -u +%FT%TZ), $(nproc) cores; py-spy: $(command -v py-spy || echo none)"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    timeout "${BENCH_GPU_S:-400}" "$python" benchmarks/bench_gpu.py "${bench_args[@]}" --out "$work/gpu" ${smoke[@]+"${smoke[@]}"}
    echo "gpu_session: bench_gpu.py exit status $?"
} 2>&1 | tee "$out/bench_gpu.txt"
if [ "${GPU_SESSION_LADDER:-0}" != 0 ]; then
    {
        timeout "${LADDER_S:-230}" "$python" benchmarks/bench_gpu_ladder.py --py-spy "$work/pyspy" ${smoke[@]+"${smoke[@]}"}
        echo "gpu_session: bench_gpu_ladder.py exit status $?"
    } 2>&1 | tee "$out/ladder.txt"
fi
[ -f "$work/gpu/bench_gpu.json" ] && cp "$work/gpu/bench_gpu.json" "$out/"
kept=()
for path in gpu/bench_gpu.json gpu/profile_vit.txt gpu/profile_swinunetr.txt gpu/pyspy_vit_active.txt gpu/pyspy_vit_gil.txt \
        gpu/pyspy_swinunetr_active.txt gpu/pyspy_swinunetr_gil.txt pyspy; do
    [ -e "$work/$path" ] && kept+=("$path")
done
if [ ${#kept[@]} -gt 0 ]; then
    tar -czf "$out/results.tar.gz" -C "$work" "${kept[@]}"
fi
echo "gpu_session: in $out: $(cd "$out" && ls | tr '\n' ' ')"
