#!/usr/bin/env bash
# The suites' headline figures and the GPU tests, a few parts per device call (under its 10-minute limit):
#
#     bash bench/session_run.sh [PART ...]     (from the repository root, on the GPU machine; carry .whl)
#
# PARTs, with the time each took on the H200 (2026-11-30):
#   attention    large and small                                                    ~260 s
#   large        every case but the learnable T5 table, B2 H16 N8192 D128          ~140 s (past 150 once; +1 case since)
#   small        the same at B8 H16 N2048 D64 (cut at 110 s once: now 170)         ~120 s
#   floor        causal, plain and the tril buffer at both shapes, fusepass's kernels (not run yet)
#                beside fusepass with SDPA where it times faster ("floor") and SDPA
#   flexmask     document, packed causal documents and padding beside            (~150 s; run once
#                FlexAttention with its block mask built in each call, as a step   by hand at -1925,
#                with new inputs builds it                                         without packed)
#   elementwise  the elementwise suite at 2^26 elements (12 rows)                   ~75 s
#   tests        the GPU tests ($TESTS, default all of tests/)                         >380 s (2026-12-04, 1,167 tests)
#   reductions   bench/reductions.py: norms, softmax, losses, beside Inductor         ~130 s (2026-12-04, 8 rows)
#   row-tiles    bench/row_tiles.py: short rows' tiles and warps (row_kernel.SHORT_ROWS since 12-07)          ~90 s (12-07, H100)
#                beside Inductor, forward
#   row-walks    bench/row_walks.py: long rows' walks (chunk, warps) on a loss and log-sum-exp, 3 walks   (~150 s: ~18 s a walk a case)
#                beside Inductor, forward and forward+backward
#   inductor-configs  bench/inductor_configs.py: Inductor's short-row LayerNorm and softmax kernels with the   (not run yet)
#                configs its autotuner kept, beside fusepass's tile, kept as bench/results/inductor-configs-<date>.txt
#   columns      bench/column_sums.py: a bias alone, LayerNorm, bias+GELU and RMSNorm (Gemma's 2304 wide among   ~30 s at one stage (12-06)
#                them) at 2 and 4 programs a multiprocessor, a wide row's walk at 8 and 16 warps
#   peaks        bench/peaks.py: a step's memory per phase and pool, $PEAK_MODELS (default bert,vit; gpt2+loss:   >300 s (bert,vit)
#                its loss compiled), $PEAK_BACKENDS (default Inductor default and reduce-overhead, fusepass with
#                whole-graph replays, its gradients lent and copied out of the pool), the $PEAK_BLOCKS largest
#                blocks live at the step's peak (default none)
#   models       bench/models.py's rows, $MODELS (default all) within $MODELS_BUDGET_S s, fusepass's $MODELS_OPTIONS     ~250 s (gpt2 alone)
#   graphs       the whole-graph replay tests (tests/runtime/test_whole_graphs*.py) and the dropout and     (~110 s tests;
#                per-op replay tests, then bench/models.py for $MODELS (default bert,vit,t5,gpt2)     with reduce-overhead:
#                                                                                    BERT ~40 s, GPT-2 ~75, T5 >300)
#                with fusepass's {"graphs": true}, beside
#                Inductor's modes $MODELS_PEERS (e.g. reduce-overhead)
#   bert         BERT-base's attention (B8 H12 N512 D64, padding and plain) beside SDPA and Inductor, then    ~130 s (2026-12-06)
#                the forward's and the step's kernels under Inductor and fusepass (bench/profile_models.py),
#                kept as bench/results/profile-models-bert-{forward,step}-<date>.txt
#   gemma2       Gemma 2's step (T8192) kernels under Inductor and fusepass, kept as          (~70 s, 12-06)
#                bench/results/profile-models-gemma2-step-<date>.txt
#   planning     bench/new_lengths.py --profile-planning: where a new length's planning spends its time   (with lengths ~65 s)
#   gradients    bench/gradient_by_parameter.py for $GRAD_MODELS (default bert,gpt2,t5): each   (not run yet)
#                parameter's bf16 gradient from float32's, eager beside fusepass
#   rings        bench/gluon_forward.py: the sm_90 forward at K/V tiles of 128 and 64 rows and rings of 2 to 4 (not run yet)
#                (the small shape's D64 forward trails SDPA), kept as bench/results/gluon-forward-rings-<date>.md
#   forward-settings  the sm_90 forward's tests, then bench/gluon_forward.py by its own rule, with a persistent grid   ~140 s
#                and with one program an item (`hopper_forward.PERSISTENT_UP_TO`) at both shapes, kept as    (12-08, H100)
#                bench/results/gluon-forward-settings-<date>.md
#   forward-persistent  bench/gluon_forward.py with a persistent grid and with one program an item between the   (not run yet)
#                suite's shapes (D128 at 2048 keys, D64 and D128 at 4096): where `PERSISTENT_UP_TO` should end, kept as
#                bench/results/gluon-forward-persistent-<date>.md
#   gluon-backward  bench/gluon_backward.py: the sm_90 backward beside the Triton backward and SDPA's, causal,      ~50 s (12-07, H100; 3 cases
#                plain, and after the Triton forward a window of 1024, padding, documents and packed documents,    of the 6)
#                at both shapes, gradients from float64, kept as bench/results/gluon-backward-<date>.md
#   latent       bench/latent_attention.py: DeepSeek's latent attention (q·k 192, V 128, causal) beside SDPA   (not run yet)
#   accuracy     bench/gradient_accuracy.py: attention's bf16 output and gradients from float64's,    ~25 s (2026-12-05, H100)
#                a key bias's among them, beside eager and SDPA (B1 H4 N4096 D128)
#   lengths      bench/new_lengths.py: a GPT-2 block trained at new lengths beside Inductor      ~66 s (2026-12-04)
#   lengths-bert the same for a padded BERT layer (a mask the kernels load)       (not run yet)
#   lengths-stack the GPT-2 blocks 12 deep (the layers share each length's plan)   (not run yet)
#   lengths-kernels the GPT-2 block at 1024, 1536, 2048, 3000 with each length's ops of most device time and its   (~50 s, 12-06)
#                per-op replays, captures and lost captures, kept as bench/results/new-lengths-kernels-<date>.txt
#   overhead     host µs per call and first-call compile time beside Inductor      ~60 s
#   compile      a fresh process's first call of the causal example (compile_time) ~100 s, past 110 on a fresh machine
#   compile-documents  the same for packed causal documents (a map built per call)  ~150 s (2026-12-01)
#   host         where a small-shape forward+backward call spends its host time,    (~40 s before --floor)
#                beside the floor of torch's layers and FlexAttention's call
#   replay       small-shape calls replayed as CUDA graphs, beside FlexAttention's  (not run yet)
#   replay-steps bench/replay_steps.py: the sequences replayed per training step of T5 and BERT, and the step   (not run yet)
#                with replays on and off
#   profile-backward  bench/profile_attention.py --backward: ncu of causal's and plain's forward+backward kernels   ~40 s a case (12-07, H100)
#                (the sm_90 kernels, the SDPA floor off) beside FlexAttention's and cuDNN's
#   profile-small  the same at the small shape, B8 H16 N2048 D64                                    ~90 s (12-08, H100)
#   sweep        the kernels at flash_config's tiles, causal B2 H16 N8192 D128,     (not run yet)
#                forward and backward beside SDPA's, with registers and spills
#   sweep-window the backward's tiles on the attention suite's sliding window (causal, 1024 keys; large shape):     (not run yet)
#                dK/dV, then dQ, each beside flash_config's other kernel (the masked tiles were chosen on causal)
#   sweep-d256   the forward at D256 (Gemma 2's attention: B1 H8, 4 kv heads, N8192, causal) at 64 × 64 and     (not run yet)
#                128 × 64 / 128 × 32 tiles, 8 warps (and 64 × 64 at 4); dK/dV together at 32 × 64, then
#                apart at 32 × 128 (BackwardConfigs.apart), causal and as Gemma 2's local layers (capped, window 4096);
#                dQ at 128 × 32 × 8 warps and 64 × 64 × 4 (64 × 64 products, no spill offline)
#   sweep-latent dK/dV at latent attention's widths (q·k 192, V 128; B2 H16 N4096, causal): together at 32 × 128   (not run yet)
#                (the choice) and 32 × 64, then apart at 32 × 128
#   order        the same kernels with their programs in groups of 1, 4 and 8       (not run yet)
#                (batch, head) pairs (FlashConfig.head_group; bench/program_order.py), and the small
#                shape's forward in groups of 1, 8 and 16
# Without PARTs: attention elementwise tests (~480 s); the others make a second call.
#
# Each suite writes bench/results/ as it always does; what this run wrote comes back as one archive,
# $OUT/results-<time this run began>.tgz (written again after each part; two runs in one call keep two), beside
# $OUT/gpu-tests.log (the device tool returns at most 8 files).
set -u
export PYTHONPATH=$PWD
OUT_DIR=${OUT:-/tmp/session-run}
mkdir -p "$OUT_DIR"
unset OUT  # the suites write bench/results only; the archive carries them back
mark=$(mktemp)
archive="$OUT_DIR/results-$(date -u +%H%M%S).tgz"
parts=${*:-attention elementwise tests}
parts=${parts//attention/large small}
for part in $parts; do
    case $part in
    large)
        timeout 210 python bench/attention.py --shapes large --cases causal,causal_buffer,plain,alibi,document,window,padding,softcap,t5 \
            2>&1 | grep "^|" | cut -d"|" -f2-13 ;;
    small)
        timeout 170 python bench/attention.py --shapes small --cases causal,causal_buffer,plain,alibi,document,window,padding,softcap,t5 \
            2>&1 | grep "^|" | cut -d"|" -f2-13 ;;
    floor)
        timeout 200 python bench/attention.py --shapes large,small --cases causal,plain,causal_buffer \
            --peers sdpa,floor 2>&1 | grep "^|" | cut -d"|" -f2-4,8,11,13-16 ;;
    flexmask)
        timeout 260 python bench/attention.py --shapes large,small --cases document,packed,padding \
            --peers sdpa,flex,flex-mask \
            2>&1 | grep "^|" | cut -d"|" -f2-4,8,10,12-13,15 ;;
    elementwise)
        timeout 100 python bench/elementwise.py --sizes 26 2>&1 | tail -12 ;;
    tests)
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
        # -v: each test's outcome is on its own line, so a run cut by the timeout still names its failures
        PYTHONPATH=/tmp/site:$PWD timeout ${TESTS_TIMEOUT_S:-520} python -m pytest -o addopts="--import-mode=importlib" \
            -v -n 15 -rf -p no:cacheprovider ${TESTS:-tests} > "$OUT_DIR/gpu-tests.log" 2>&1
        grep -E "FAILED|ERROR" "$OUT_DIR/gpu-tests.log" | sed 's/^\[gw[0-9]*\] \[...%\] //' | sort -u | head -40
        tail -1 "$OUT_DIR/gpu-tests.log" ;;
    reductions)
        (cd bench && timeout 280 python reductions.py 2>&1 | grep -E "^\||Error" | cut -c1-330) ;;
    row-tiles)
        (cd bench && timeout 200 python row_tiles.py 2>&1 | grep "^|" | cut -c1-330) ;;
    row-walks)
        (cd bench && timeout 280 python row_walks.py --cases cross-entropy-bf16,logsumexp-by-hand \
            --walks 4096:8,4096:16,1024:4 2>&1 | grep "^|" | cut -c1-400) ;;
    inductor-configs)
        kept=bench/results/inductor-configs-$(date -u +%Y-%m-%d-%H%M).txt
        (cd bench && timeout 120 python inductor_configs.py) > "$kept" 2>&1
        grep -E "^==|^--" "$kept" ;;
    rings)
        kept=bench/results/gluon-forward-rings-$(date -u +%Y-%m-%d-%H%M).md
        timeout 200 python bench/gluon_forward.py --shapes "8,16,2048,64;2,16,8192,128" \
            --rings "128,2;64,3;64,4;128,3" > "$kept" 2>&1
        grep -E "^\||Error" "$kept" ;;
    forward-settings)
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
        PYTHONPATH=/tmp/site:$PWD timeout 150 python -m pytest -o addopts="--import-mode=importlib" -q -n 8 \
            -p no:cacheprovider tests/flash/test_hopper_forward.py > "$OUT_DIR/gpu-tests-forward-settings.log" 2>&1
        tail -1 "$OUT_DIR/gpu-tests-forward-settings.log"
        kept=bench/results/gluon-forward-settings-$(date -u +%Y-%m-%d-%H%M).md
        timeout 120 python bench/gluon_forward.py --shapes "2,16,8192,128;8,16,2048,64" --rings "128,2;128,2,1;128,2,0" \
            > "$kept" 2>&1
        grep -E "^\||Error" "$kept" ;;
    forward-persistent)
        kept=bench/results/gluon-forward-persistent-$(date -u +%Y-%m-%d-%H%M).md
        timeout 200 python bench/gluon_forward.py --shapes "8,16,2048,128;4,16,4096,64;4,16,4096,128" \
            --rings "128,2,1;128,2,0" > "$kept" 2>&1
        grep -E "^\||Error" "$kept" ;;
    gluon-backward)
        kept=bench/results/gluon-backward-$(date -u +%Y-%m-%d-%H%M).md
        (cd bench && timeout 240 python gluon_backward.py) > "$kept" 2>&1
        grep -E "^\||Error" "$kept" ;;
    latent)
        timeout 300 python bench/latent_attention.py 2>&1 | grep -E "^\||Error" ;;
    peaks)
        timeout 540 python bench/peaks.py --models "${PEAK_MODELS:-bert,vit}" --at-peak "${PEAK_BLOCKS:-0}" \
            --backends "${PEAK_BACKENDS:-inductor,inductor-reduce-overhead,fusepass-graphs,fusepass-graphs-copied}" 2>&1 \
            | grep -E "^\||failed|^==|^  [0-9]|at its peak" | cut -c1-300 ;;
    columns)
        timeout 240 python bench/column_sums.py --programs 2,4 --tiles 2048 --stages 3 --warps 8,16 \
            --cases bias,rmsnorm,layernorm 2>&1 | grep "^|" ;;
    models)
        timeout ${MODELS_TIMEOUT_S:-560} python bench/models.py --models "${MODELS:-gpt2,llama,bert,t5,vit,gemma2}" \
            --budget-s "${MODELS_BUDGET_S:-400}" --options "${MODELS_OPTIONS:-{\}}" 2>&1 | grep -E "^\||Error|error:" | cut -c1-400 ;;
    graphs)
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
        PYTHONPATH=/tmp/site:$PWD timeout 200 python -m pytest -o addopts="--import-mode=importlib" -v -n 4 -rf \
            -p no:cacheprovider tests/runtime/test_whole_graphs_cuda.py tests/runtime/test_whole_graphs.py \
            tests/attention/forms/test_dropout.py tests/attention/test_replay.py tests/flash/test_flash.py \
            -k "whole_graphs or dropout or replay" > "$OUT_DIR/gpu-tests-graphs.log" 2>&1
        grep -E "FAILED|ERROR" "$OUT_DIR/gpu-tests-graphs.log" | sort -u | head -20
        tail -1 "$OUT_DIR/gpu-tests-graphs.log"
        timeout ${MODELS_TIMEOUT_S:-400} python bench/models.py --models "${MODELS:-bert,vit,t5,gpt2}" \
            --budget-s "${MODELS_BUDGET_S:-380}" --options '{"graphs": true}' --peers "${MODELS_PEERS:-}" 2>&1 | grep -E "^\||Error|error:" \
            | cut -c1-400 ;;
    bert)
        timeout 90 python bench/attention.py --shapes bert --cases padding,plain --peers sdpa,inductor 2>&1 | grep "^|" \
            | cut -d"|" -f2-4,8,11-12,14,16-17
        for what in forward step; do
            kept=bench/results/profile-models-bert-$what-$(date -u +%Y-%m-%d-%H%M).txt
            (cd bench && timeout 120 python profile_models.py --models bert --rows 30 $([ $what = forward ] && echo --forward)) \
                > "$kept" 2>&1
            grep "^==" "$kept"
        done ;;
    gemma2)
        kept=bench/results/profile-models-gemma2-step-$(date -u +%Y-%m-%d-%H%M).txt
        (cd bench && timeout 200 python profile_models.py --models gemma2 --rows 30) > "$kept" 2>&1
        grep "^==" "$kept" ;;
    planning)
        timeout 150 python bench/new_lengths.py --profile-planning 2>&1 | grep "^|" | cut -c1-300 ;;
    gradients)
        for model in $(echo "${GRAD_MODELS:-bert,gpt2,t5}" | tr , " "); do
            echo "$model"
            timeout 150 python bench/gradient_by_parameter.py --model "$model" --top 6 2>&1 | grep -E "^\||worst|Error"
        done ;;
    accuracy)
        (cd bench && timeout 120 python gradient_accuracy.py --shape 1,4,4096,128 \
            --out "results/gradient-accuracy-$(date -u +%Y-%m-%d-%H%M).md" 2>&1 | grep -E "^\||worst|Error") ;;
    lengths)
        timeout 200 python bench/new_lengths.py 2>&1 | grep "^|" | cut -c1-300 ;;
    lengths-bert)
        timeout 200 python bench/new_lengths.py --model bert --lengths 256,384,512,320,448 --batch 8 2>&1 \
            | grep "^|" | cut -c1-300 ;;
    lengths-stack)
        timeout 300 python bench/new_lengths.py --layers 12 --lengths 1024,1536,2048,3000,4096 2>&1 \
            | grep "^|" | cut -c1-300 ;;
    lengths-kernels)
        kept=bench/results/new-lengths-kernels-$(date -u +%Y-%m-%d-%H%M).txt
        timeout 200 python bench/new_lengths.py --lengths 1024,1536,2048,3000 --kernels 14 > "$kept" 2>&1
        grep "^|" "$kept" | cut -c1-60,200-400
        for n in 2048 3000; do grep -A19 "== fusepass at $n" "$kept" | grep -v "^---" | cut -c1-70,150-215; done ;;
    overhead)
        (cd bench && timeout 80 python overhead.py 2>&1 | tail -10) ;;
    compile)
        (cd bench && timeout 170 python compile_time.py --models causal 2>&1 | tail -10) ;;
    compile-documents)
        (cd bench && timeout 200 python compile_time.py --models documents 2>&1 | tail -10) ;;
    host)
        (cd bench && timeout 170 python launch_cost.py --cases window,document --backward --shape small --layers \
            --floor 2>&1 | tail -6) ;;
    replay)
        (cd bench && timeout 150 python graph_replay.py --cases window,document,causal,alibi --shape small 2>&1 \
            | grep "^|") ;;
    replay-steps)
        (cd bench && timeout 200 python replay_steps.py --models t5,bert --steps 12 2>&1 | grep "^|") ;;
    profile-backward)
        (cd bench && timeout 240 python profile_attention.py --cases causal,plain --backward 2>&1 | grep -E "^\||Error" \
            | cut -c1-400) ;;
    profile-small)
        (cd bench && timeout 240 python profile_attention.py --cases causal,plain --backward --shape 8,16,2048,64 2>&1 \
            | grep -E "^\||Error" | cut -c1-400) ;;
    sweep)
        (cd bench && timeout 150 python flash_sweep.py --chosen 2>&1 | grep "^|") ;;
    sweep-window)
        (cd bench && timeout 280 python flash_sweep.py --mask window --dkdv 64,64,4,2 32,64,4,3 32,128,4,3 64,128,8,2 \
            2>&1 | grep "^|"
            timeout 250 python flash_sweep.py --mask window --dq 128,64,8,3 64,64,4,3 64,128,4,3 128,128,8,2 \
            2>&1 | grep "^|") ;;
    sweep-d256)
        (cd bench && d256="--head-dim 256 --seq 8192 --batch 1 --heads 8 --kv-heads 4"
            timeout 150 python flash_sweep.py $d256 --forward 64,64,8,2 128,64,8,2 128,32,8,2 64,64,4,2 --forward-only \
                2>&1 | grep "^|"
            for mask in causal softcap-window; do
                timeout 100 python flash_sweep.py $d256 --mask $mask --dkdv 32,64,8,2 2>&1 | grep "^| [sb]"
                timeout 100 python flash_sweep.py $d256 --mask $mask --dkdv 32,128,8,2 --dkdv-apart 2>&1 | grep "^| b"
            done
            timeout 100 python flash_sweep.py $d256 --dq 128,32,8,2 64,64,4,2 2>&1 | grep "^| b") ;;
    sweep-latent)
        (cd bench && latent="--head-dim 192 --head-dim-v 128 --seq 4096 --batch 2 --heads 16"
            timeout 100 python flash_sweep.py $latent --dkdv 32,128,8,2 32,64,8,2 2>&1 | grep "^| [sb]"
            timeout 100 python flash_sweep.py $latent --dkdv 32,128,8,2 --dkdv-apart 2>&1 | grep "^| b") ;;
    order)
        (cd bench && for swept in "--forward 128,128,8,3,1 128,128,8,3,4 128,128,8,3,8 --forward-only" \
                "--dq 128,64,8,3,1 128,64,8,3,4 128,64,8,3,8" "--dkdv 64,64,4,2,1 64,64,4,2,4 64,64,4,2,8" \
                "--head-dim 64 --seq 2048 --batch 8 --forward 64,64,4,3,1 64,64,4,3,8 64,64,4,3,16 --forward-only"; do
            timeout 100 python flash_sweep.py $swept 2>&1 | grep "^| [fb]" | cut -c1-200
        done) ;;
    *)
        echo "unknown part: $part" ;;
    esac
    # After each part: a call cut by the device's limit still brings back what the parts before wrote.
    find bench/results -newer "$mark" -type f -print0 | tar czf "$archive" --null -T -
done
