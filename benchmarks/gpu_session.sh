#!/usr/bin/env bash
# The GPU session's steps, run on the device machine from the repository root by the `run`
# tool (see benchmarks/gpu_session.md for the calls, their order and their device time):
#
#   bash benchmarks/gpu_session.sh STEP [STEP ...]
#
#   setup       install the carried wheels (.whl/*.whl) into /tmp/site, restore carried
#               flashinfer kernels (.whl/fi_aot.tgz*), `pip install -e .`; print the machine
#   parity      tests/gpu/test_parity_gpu.py (fp32 greedy, bf16 flashinfer teacher forcing),
#               writing benchmarks/results/gpu_parity.json; then benchmarks/bf16_noise.py on
#               the same models (transformers' bf16 against its float32: gpu_bf16_noise.json)
#   parity-windows  its sliding-window and Gemma 3 cases (Triton and flashinfer windowed
#               kernels), writing benchmarks/results/gpu_parity_windows.json
#   seed-shape | decode-bs1 | overlap    one benchmark of benchmarks/gpu_bench.py, --profile
#   tests-fi    tests/gpu/test_flashinfer_gpu.py on 4 pytest-xdist workers (flashinfer
#               compiles its fp16/bf16 x head_dim 64/128 variants)
#   tests-kernels  tests/gpu/test_kernels_gpu.py, test_cuda_graph_gpu.py and
#               test_hybrid_swa_gpu.py (hybrid window memory == plain, graphs on and off),
#               test_encoders_gpu.py (BERT / XLM-R == transformers on the GPU),
#               test_hicache_gpu.py (hierarchical cache == plain radix cache),
#               test_kernels_page_table.py (flashinfer's page ids in one launch),
#               test_allocator_gpu.py (the allocator on CUDA == on CPU, deferred checks),
#               test_logits_gpu.py (GPT-2's lm_head over padded weight rows: agrees, not
#               slower than F.linear, not cutlass's align1 kernel; prints the three timings)
#   tests-overlap  tests/gpu/test_overlap_gpu.py (no launch of the CUDA overlap executor
#               waits for a busy forward stream) and the GPU cases of
#               tests/integration/test_overlap.py (CUDA executor == plain loop)
#   host-profile  benchmarks/host_profile.py: wall time of seed-shape waves (overlap and CUDA
#               graphs on / off, and a decode-heavy wave) and the host's cProfile of one wave
#   decode-backends  benchmarks/gpu_decode_backends.py: decode step time of flashinfer's and
#               Triton's decode attention (flashinfer prefill) from batch 1 at 8k tokens to
#               batch 256 at 512, writing benchmarks/results/gpu_decode_backends.json
#   flashinfer-plan  benchmarks/flashinfer_plan.py --device cuda: host time of planning a
#               decode batch, the backend's fast re-plan against flashinfer's plan (real
#               planners), writing benchmarks/results/gpu_flashinfer_plan.json
#   smoke       gpu_bench.py all --device cpu --quick (the script's own check; no GPU)
#   speculative tests/gpu/test_verify_graphs_gpu.py (verify steps replayed from CUDA graphs ==
#               eager, Triton and flashinfer; speculative tokens == plain decoding's, chains
#               and draft trees), then tests/gpu/test_eagle_gpu.py (EAGLE heads' graphs,
#               trees, hicache, MTP layers; tokens == plain)
#   speculative-bench  benchmarks/speculative.py on the GPU (bf16, 8 layers): n-gram
#               speculative decoding (chain and tree arms) against plain decoding, writing
#               benchmarks/results/gpu_speculative.json; then benchmarks/speculative_draft.py
#               (bf16, 16 layers, a first-layer draft): a draft model's and EAGLE heads' (a
#               derived EAGLE head, chained and as trees; a random EAGLE-3 one), writing
#               benchmarks/results/gpu_speculative_draft.json
#   lora        benchmarks/lora.py on the GPU (bf16, 8 layers, 64 requests): adapters against the
#               base model, and mixed adapters with the decode graphs against eager (the graphs
#               record the LoRA layers over every slot), writing benchmarks/results/gpu_lora.json
#   int-weight  tests/gpu/test_int_weight_gpu.py (the W4A16 / W8A16 GEMM against its reference at
#               a 4096 x 4096 layer; a tiny W4A16 model's greedy tokens against transformers),
#               then benchmarks/int_weight.py (Llama-3.2-1B shape, bf16: full, w4a16, w8a16),
#               writing benchmarks/results/gpu_int_weight.json (needs the compressed-tensors,
#               loguru and pydantic wheels carried in .whl/)
#   speculative-mtp  benchmarks/speculative_mtp.py on the GPU (bf16, DeepSeek-V3 shape, 8
#               layers): a model drafting with its own MTP layer (a derived layer, chained
#               and as trees; a random one) against plain decoding, writing
#               benchmarks/results/gpu_speculative_mtp.json
#   embeddings  benchmarks/embeddings.py on the GPU (bf16, 8 layers, 512 inputs): the embedding
#               engine against transformers, writing benchmarks/results/gpu_embeddings.json;
#               then benchmarks/encoders.py (BERT-base shape, 1024 inputs): gpu_encoders.json
#   fp8         tests/gpu/test_fp8_gpu.py, benchmarks/fp8_noise.py (its teacher-forced
#               agreements, float32 and bf16: gpu_fp8_noise.json), then benchmarks/fp8.py
#               (Llama-3.2-1B shape, bf16): FP8 weights against bf16, writing gpu_fp8.json
#   kv-fp8      tests/gpu/test_kv_fp8_gpu.py, then benchmarks/kv_fp8.py (Llama-3.2-1B shape,
#               bf16, 256 x 1024-token prompts): the FP8 KV cache against bf16 on the same KV
#               bytes, writing benchmarks/results/gpu_kv_fp8.json
#   gemv        the Triton GEMV's tests (kernel and engine routing), benchmarks/gpu_gemv.py
#               (against cuBLAS at Llama-3.2-1B's projections, M 1-16, with a tile sweep:
#               gpu_gemv.json), then decode-bs1 default vs --gemv-backend triton
#               (gpu_decode_bs1_gemv.json)
#   ops         benchmarks/gpu_fused_kernels.py --skip-decode: the fused elementwise kernels,
#               the argmax, and greedy over bf16 logits against their float32 conversion
#               (gpu_fused_kernels_ops.json)
#   pdl         tests/gpu/test_pdl_gpu.py (PDL: the same greedy tokens as plain launches;
#               on by default with the Triton GEMV), decode-bs1 of the default (GEMV + PDL)
#               against cuBLAS with and without PDL and the GEMV without it
#               (gpu_decode_bs1_pdl.json), overlap with PDL (gpu_overlap_pdl.json)
#   memory      tests/gpu/test_memory_release_gpu.py (sleep levels 1 and 2 free the weights,
#               the KV pool and the graphs, the same tokens after the wake-up), then
#               benchmarks/memory_release.py on CUDA (bf16, 16 layers): the wake-up against
#               restarting, writing benchmarks/results/gpu_memory_release.json
#   bench = seed-shape decode-bs1 overlap;  tests = parity tests-overlap tests-fi
#   tests-kernels parity-windows;  all = parity bench tests-overlap tests-fi tests-kernels
#   parity-windows (the issue's results first)
#
#   bash benchmarks/gpu_session.sh exec CMD [ARG ...]   CMD after setup, e.g. one benchmark
#                                                       with other flags; results packed too
#
# setup runs first whatever the steps. Each step runs only if the time left in this call
# (GPU_SESSION_BUDGET_S, default 560 s: the tool stops a command at 600 s) covers its
# estimate, and under a timeout that leaves time to pack; $OUT/status.txt says what ran,
# its exit code and seconds, or why it was skipped. After every step the results
# (benchmarks/results/gpu_*) are packed into $OUT/results.tgz; after parity, tests-fi and at
# the end, flashinfer's compiled kernels into $OUT/fi_aot.tgz. $OUT gets at most 7 files:
# log.txt, status.txt, env.txt, results.tgz, fi_aot.tgz (or up to 3 parts of it).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sluice-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!
FAILED=0  # the exit code: 1 if any step failed
START=$(date +%s)
BUDGET=${GPU_SESSION_BUDGET_S:-560}
SITE=/tmp/site
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --timeout 300)

left() { echo $((BUDGET - ($(date +%s) - START))); }

status() { echo "$*" | tee -a "$OUT/status.txt"; }

run_step() {  # run_step NAME ESTIMATE_S CMD...: run CMD if ESTIMATE_S fit in the time left
    local name=$1 est=$2 t rc
    shift 2
    if (($(left) < est)); then
        status "$name: skipped ($(left)s left, needs ~${est}s)"
        return 0
    fi
    t=$(date +%s)
    echo "=== $name ($(left)s left)"
    local limit=$(($(left) - 25))
    ((limit > 5)) || limit=5
    timeout -s INT -k 20 "$limit" "$@"
    rc=$?
    ((rc == 0)) || FAILED=1
    status "$name: rc=$rc $(($(date +%s) - t))s"
    pack_results
}

setup() {
    if [ -n "${GPU_SESSION_NO_INSTALL:-}" ]; then  # a dry run where the packages are installed
        status "setup: no install (GPU_SESSION_NO_INSTALL)"
    elif ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || status "setup: wheel install FAILED"
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
    local aot=(.whl/fi_aot.tgz.part*)  # one file, or parts of one (cat in name order)
    [ -f .whl/fi_aot.tgz ] && aot=(.whl/fi_aot.tgz)
    if [ -f "${aot[0]}" ] && [ -d "$SITE/flashinfer" ]; then
        mkdir -p "$SITE/flashinfer/data/aot"
        cat "${aot[@]}" | tar xz -C "$SITE/flashinfer/data/aot" &&
            status "setup: restored $(ls "$SITE/flashinfer/data/aot" | wc -l) flashinfer kernels"
    fi
    if [ -z "${GPU_SESSION_NO_INSTALL:-}" ]; then
        python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 ||
            export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
            --format=csv 2>&1
        echo "nvcc: $(command -v nvcc) $(nvcc --version 2>/dev/null | tail -1)"
        python3 - <<'EOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("transformers", "triton", "flashinfer-python", "apache-tvm-ffi", "sluice",
             "pytest-xdist", "redis", "fastapi", "uvicorn"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
try:
    import flashinfer
    print("import flashinfer: ok", flashinfer.__version__)
except Exception as exc:  # noqa: BLE001
    print("import flashinfer: FAILED", repr(exc))
EOF
    } | tee "$OUT/env.txt"
}

pack_results() {
    local files
    files=$(cd benchmarks/results && ls gpu_* 2>/dev/null)
    [ -n "$files" ] && tar czf "$OUT/results.tgz" -C benchmarks/results $files
}

pack_aot() {  # flashinfer's compiled kernels (JIT cache + restored ones), for the next call
    local stage=/tmp/fi_aot_stage size
    rm -rf "$stage" /tmp/fi_aot.tgz "$OUT"/fi_aot.tgz*
    mkdir -p "$stage"
    for d in "$SITE/flashinfer/data/aot" "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops; do
        [ -d "$d" ] || continue
        (cd "$d" && find . -name '*.so' -exec cp --parents {} "$stage" \;)
    done
    [ -n "$(ls "$stage")" ] || { status "pack_aot: no compiled flashinfer kernels"; return 0; }
    tar czf /tmp/fi_aot.tgz -C "$stage" .
    size=$(stat -c %s /tmp/fi_aot.tgz)
    if ((size <= 15 * 1024 * 1024)); then
        cp /tmp/fi_aot.tgz "$OUT/fi_aot.tgz"
    elif ((size <= 45 * 1024 * 1024)); then
        split -b 15M -d /tmp/fi_aot.tgz "$OUT/fi_aot.tgz.part"
    else
        status "pack_aot: $((size >> 20)) MiB of kernels, too big to return; not packed"
        return 0
    fi
    status "pack_aot: $(ls "$stage" | wc -l) kernels, $((size >> 20)) MiB"
}

BENCH=(python3 benchmarks/gpu_bench.py)

do_step() {
    case $1 in
        setup) ;;
        parity)
            # its first flashinfer test waits for the JIT compile: longer timeout
            run_step parity 260 env SLUICE_WRITE_RESULTS=1 "${PYTEST[@]}" --timeout 500 \
                tests/gpu/test_parity_gpu.py -k "not sliding and not gemma"
            # the floor beside it: transformers' own bf16 against its float32, same models
            run_step bf16-noise 60 python3 benchmarks/bf16_noise.py --device cuda \
                --backend flashinfer --archs llama qwen3 gpt2 qwen3_moe --qk-scales 1 \
                --name gpu_bf16_noise
            pack_aot ;;
        parity-windows)
            # flashinfer JIT-compiles its sliding-window and soft-cap variants first
            run_step parity-windows 240 env SLUICE_WRITE_RESULTS=1 \
                SLUICE_PARITY_RESULTS=gpu_parity_windows "${PYTEST[@]}" --timeout 500 \
                tests/gpu/test_parity_gpu.py -k "sliding or gemma"
            pack_aot ;;
        tests-fi)
            # a worker's first test waits for the JIT compile of its variant: longer timeout
            run_step tests-fi 300 "${PYTEST[@]}" --timeout 500 -n 4 \
                tests/gpu/test_flashinfer_gpu.py
            pack_aot ;;
        tests-kernels)
            # 4 workers (Triton compiles on the host's 16 cores, flashinfer JITs once, locked);
            # the logits test times kernels, so it runs alone afterwards
            run_step tests-kernels 260 "${PYTEST[@]}" -n 4 --dist load \
                tests/gpu/test_kernels_gpu.py \
                tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_hybrid_swa_gpu.py \
                tests/gpu/test_encoders_gpu.py tests/gpu/test_hicache_gpu.py \
                tests/gpu/test_fused_kernels_gpu.py tests/unit/test_fp8.py \
                tests/unit/test_kernels_page_table.py tests/unit/test_kernels_argmax.py \
                tests/gpu/test_allocator_gpu.py
            run_step tests-logits 40 "${PYTEST[@]}" tests/gpu/test_logits_gpu.py ;;
        tests-overlap) run_step tests-overlap 90 "${PYTEST[@]}" tests/gpu/test_overlap_gpu.py \
                tests/integration/test_overlap.py -m gpu ;;
        host-profile)
            run_step host-profile 150 python3 benchmarks/host_profile.py --name gpu_host_profile \
                --config default --config no_overlap:disable_overlap_schedule=True \
                --config no_graph:disable_cuda_graph=True \
                --config decode64:num_prompts=64,input_len=32,output_len=256 ;;
        seed-shape) run_step seed-shape 100 "${BENCH[@]}" seed-shape --profile ;;
        decode-bs1) run_step decode-bs1 300 "${BENCH[@]}" decode-bs1 --profile ;;
        pdl)
            run_step pdl-tests 120 "${PYTEST[@]}" tests/gpu/test_pdl_gpu.py
            run_step pdl-decode 150 "${BENCH[@]}" decode-bs1 --profile --tag pdl \
                --decode-configs cuda_graph cuda_graph_cublas cuda_graph_cublas_pdl \
                cuda_graph_triton_gemv
            run_step pdl-overlap 130 "${BENCH[@]}" overlap --profile --tag pdl \
                --engine-arg enable_pdl=True ;;
        overlap) run_step overlap 130 "${BENCH[@]}" overlap --profile ;;
        ops) run_step ops 60 python3 -m benchmarks.gpu_fused_kernels --skip-decode \
                --json benchmarks/results/gpu_fused_kernels_ops.json ;;
        decode-backends)
            run_step decode-backends 200 python3 benchmarks/gpu_decode_backends.py ;;
        gemv)
            run_step gemv-tests 200 "${PYTEST[@]}" tests/unit/test_kernels_gemv.py \
                tests/unit/test_gemv_engine.py
            run_step gemv-ops 180 python3 benchmarks/gpu_gemv.py
            run_step gemv-decode 120 "${BENCH[@]}" decode-bs1 --profile --tag gemv \
                --decode-configs cuda_graph cuda_graph_cublas ;;
        flashinfer-plan)
            run_step flashinfer-plan 60 python3 benchmarks/flashinfer_plan.py --device cuda ;;
        smoke)
            run_step smoke 60 "${BENCH[@]}" all --device cpu --quick \
                --results-dir /tmp/sluice-gpu-smoke ;;
        speculative)
            run_step tests-verify-graphs 200 "${PYTEST[@]}" tests/gpu/test_verify_graphs_gpu.py
            run_step tests-eagle 240 "${PYTEST[@]}" tests/gpu/test_eagle_gpu.py ;;
        speculative-bench)  # (its own call: the tree arms made it longer than one's limit)
            run_step speculative 200 python3 benchmarks/speculative.py --device cuda \
                --dtype bfloat16 --layers 8 --name gpu_speculative
            run_step speculative-draft 240 python3 benchmarks/speculative_draft.py --device cuda \
                --dtype bfloat16 --layers 16 --name gpu_speculative_draft ;;
        lora)
            run_step lora 240 python3 benchmarks/lora.py --device cuda --dtype bfloat16 \
                --layers 8 --requests 64 --name gpu_lora ;;
        int-weight)
            run_step int-weight-tests 150 "${PYTEST[@]}" --timeout 300 \
                tests/gpu/test_int_weight_gpu.py
            run_step int-weight-bench 150 python3 benchmarks/int_weight.py --preset llama-3.2-1b \
                --device cuda --dtype bfloat16 --decode-tokens 128 --prefill-prompts 64 \
                --kv-tokens 65536 --name gpu_int_weight ;;
        speculative-mtp)
            run_step speculative-mtp 180 python3 benchmarks/speculative_mtp.py --device cuda \
                --dtype bfloat16 --layers 8 --name gpu_speculative_mtp ;;
        embeddings)
            run_step embeddings 120 python3 benchmarks/embeddings.py --device cuda \
                --dtype bfloat16 --layers 8 --inputs 512 --hf-batch 64 --profile \
                --name gpu_embeddings
            run_step encoders 90 python3 benchmarks/encoders.py --device cuda \
                --dtype bfloat16 --shape base --inputs 1024 --hf-batch 64 --name gpu_encoders ;;
        fp8)
            run_step fp8-tests 200 "${PYTEST[@]}" --timeout 400 tests/gpu/test_fp8_gpu.py
            run_step fp8-noise 90 python3 benchmarks/fp8_noise.py --device cuda --qk-scales 1 \
                --name gpu_fp8_noise
            run_step fp8-bench 150 python3 benchmarks/fp8.py --preset llama-3.2-1b --device cuda \
                --dtype bfloat16 --decode-tokens 128 --prefill-prompts 64 --kv-tokens 65536 \
                --name gpu_fp8
            # every arm on cuBLAS and the float8 GEMM: what the batch-1 GEMVs change
            run_step fp8-bench-gemm 150 python3 benchmarks/fp8.py --preset llama-3.2-1b \
                --device cuda --dtype bfloat16 --decode-tokens 128 --prefill-prompts 64 \
                --kv-tokens 65536 --gemv-backend torch --name gpu_fp8_gemm ;;
        memory)
            run_step memory-tests 150 "${PYTEST[@]}" --timeout 300 \
                tests/gpu/test_memory_release_gpu.py tests/gpu/test_weight_distributed_gpu.py
            run_step memory-bench 120 python3 benchmarks/memory_release.py --device cuda \
                --dtype bfloat16 --layers 16 --kv-tokens 262144 --name gpu_memory_release ;;
        kv-fp8)
            run_step kv-fp8-tests 150 "${PYTEST[@]}" --timeout 400 tests/gpu/test_kv_fp8_gpu.py
            run_step kv-fp8-bench 150 python3 benchmarks/kv_fp8.py --preset llama-3.2-1b \
                --device cuda --dtype bfloat16 --requests 256 --context 1024 --output 128 \
                --score-prompts 32 --score-len 512 --name gpu_kv_fp8 ;;
        bench) do_step seed-shape; do_step decode-bs1; do_step overlap ;;
        tests) do_step parity; do_step tests-overlap; do_step tests-fi; do_step tests-kernels
            do_step parity-windows ;;
        all) do_step parity; do_step bench; do_step tests-overlap; do_step tests-fi
            do_step tests-kernels; do_step parity-windows ;;
        *) status "unknown step $1"; return 2 ;;
    esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
setup
if [ "$1" = exec ]; then
    shift
    run_step exec 0 "$@"
else
    for s in "$@"; do do_step "$s"; done
fi
pack_aot
status "done in $(($(date +%s) - START))s"
exec 1>&- 2>&-  # let tee write the last lines before the command returns
wait "$TEE_PID" 2>/dev/null || sleep 1
exit "$FAILED"
