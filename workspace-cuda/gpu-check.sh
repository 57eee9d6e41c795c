#!/usr/bin/env bash
# Runs workspace-cuda's checks on a machine with a GPU from prebuilt binaries (no Rust
# toolchain or network needed there).
#
#   workspace-cuda/gpu-check.sh build DIR        # here: build the binaries into DIR
#   workspace-cuda/gpu-check.sh run DIR [OUT]    # on the GPU machine: run them, logs in OUT
#
# `build` puts in DIR: workspace_cuda-unit and workspace_cuda-device (the test binaries:
# the device suite runs the policy table on the simulator and on GPU 0), cuda_smoke,
# device_plan and train_digits (the examples: train_digits --device cuda trains the MLP
# on the GPU), carve-integration (carve's tests; its device suite runs) and cuda_bench
# (the criterion bench), plus this script; about 40 MB in all
# (debug info stripped). They load libcuda at run time and need nothing else but glibc.
# `run` runs each with its output in OUT (default DIR/results), then prints a summary:
# it fails when a test fails, when the smoke run fails, or when a GPU is visible
# (nvidia-smi) but the real-GPU suite was skipped or cuda_smoke found no device.
set -euo pipefail

usage() { sed -n '2,16p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
mode=$1
dir=$2

# copy_executable NAME DEST CARGO-COMMAND...: builds with `CARGO-COMMAND --no-run` and
# copies the executable of the target named NAME to DEST.
copy_executable() {
    local name=$1 dest=$2 exe
    shift 2
    exe=$("$@" --no-run --message-format=json 2>/dev/null | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$name")
    [ -n "$exe" ] || { echo "$name was not built ($*)" >&2; exit 1; }
    cp "$exe" "$dest"
}

build() {
    local root script
    root="$(cd "$(dirname "$0")/.." && pwd)"
    script="$root/workspace-cuda/gpu-check.sh"
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    cd "$root"
    local tests
    tests=$(cargo test -p workspace-cuda --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])')
    [ -n "$tests" ] || { echo "no test binaries were built" >&2; exit 1; }
    while read -r kind name exe; do
        if [ "$kind" = lib ]; then cp "$exe" "$dir/workspace_cuda-unit"; else cp "$exe" "$dir/workspace_cuda-$name"; fi
    done <<< "$tests"
    cargo build --release --example cuda_smoke --example device_plan --example train_digits --example train_gpt
    cp target/release/examples/cuda_smoke "$dir/cuda_smoke"
    cp target/release/examples/device_plan "$dir/device_plan"
    cp target/release/examples/train_digits "$dir/train_digits"
    cp target/release/examples/train_gpt "$dir/train_gpt"
    cp examples/data/digits.csv.gz examples/data/shakespeare.txt.gz "$dir/"
    cp benches/gpu_torch.py benches/gpt_torch.py "$dir/"
    # carve's device training suite (tests/integration/device.rs): the simulated device
    # against the host, the kernels through NVRTC, a CUDA device's errors.
    copy_executable integration "$dir/carve-integration" cargo test -p carve --test integration
    copy_executable cuda "$dir/cuda_bench" cargo bench --bench cuda
    # Debug info makes up most of the bytes (~100 MB in all); symbols stay for backtraces.
    if command -v strip >/dev/null 2>&1; then
        strip --strip-debug "$dir/workspace_cuda-"* "$dir/cuda_smoke" "$dir/device_plan" "$dir/cuda_bench" \
            "$dir/train_digits" "$dir/train_gpt" "$dir/carve-integration"
    fi
    cp "$script" "$dir/gpu-check.sh"
    ls -l "$dir"
    echo "on the GPU machine: $dir/gpu-check.sh run $dir"
}

run() {
    local out=${3:-$dir/results}
    mkdir -p "$out"
    local failed=0 gpu_visible=0
    # cuBLAS and NVRTC (CUDA 12 or 13): a toolkit's, or those of PyTorch's nvidia wheels.
    local libs
    libs=$(python3 -c 'import glob, os, site, sys
dirs = set()
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    for name in ("libcublas.so*", "libnvrtc.so*"):
        for lib in glob.glob(os.path.join(root, "nvidia", "**", name), recursive=True):
            dirs.add(os.path.dirname(lib))
for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
    if os.path.isdir(d):
        dirs.add(d)
print(":".join(sorted(dirs)))' 2>/dev/null || true)
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "CUDA libraries from: ${libs:-the default search path}"
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >"$out/nvidia-smi.log" 2>&1; then
        gpu_visible=1
    fi
    for name in workspace_cuda-unit workspace_cuda-device; do
        echo "=== $name"
        if "$dir/$name" >"$out/$name.log" 2>&1; then
            grep -E '^test result' "$out/$name.log" || true
        else
            echo "FAILED (see $out/$name.log)"
            grep -E 'FAILED|panicked' "$out/$name.log" | head -20 || true
            failed=1
        fi
        if grep -q 'real-GPU suite skipped' "$out/$name.log"; then
            grep 'real-GPU suite skipped' "$out/$name.log"
            if [ "$gpu_visible" = 1 ]; then
                echo "FAILED: nvidia-smi sees a GPU but the real-GPU suite was skipped"
                failed=1
            fi
        fi
    done
    echo "=== cuda_smoke"
    "$dir/cuda_smoke" --json >"$out/cuda_smoke.log" 2>&1 || failed=1
    cat "$out/cuda_smoke.log"
    if [ "$gpu_visible" = 1 ] && grep -q '"cuda":false' "$out/cuda_smoke.log"; then
        echo "FAILED: nvidia-smi sees a GPU but cuda_smoke found none"
        failed=1
    fi
    echo "=== device_plan"
    # Device plan groups on the GPU (the simulated device without one): planned bytes
    # against one device workspace per role, on one stream and on two.
    local plan_args=(--json)
    [ "$gpu_visible" = 1 ] && plan_args+=(--gpu)
    if "$dir/device_plan" "${plan_args[@]}" >"$out/device_plan.log" 2>&1; then
        cat "$out/device_plan.log"
    else
        echo "FAILED (see $out/device_plan.log)"
        failed=1
    fi
    echo "=== cuda_bench"
    if "$dir/cuda_bench" --bench --warm-up-time 1 --measurement-time 3 >"$out/cuda_bench.log" 2>&1; then
        grep -E 'skipped|^cuda_|time:|thrpt:' "$out/cuda_bench.log" || true
    else
        echo "FAILED (see $out/cuda_bench.log)"
        failed=1
    fi
    echo "=== carve device suite"
    if CARVE_REQUIRE_NVRTC=1 "$dir/carve-integration" device:: >"$out/carve_device.log" 2>&1; then
        grep -E '^test result' "$out/carve_device.log" || true
    else
        echo "FAILED (see $out/carve_device.log)"
        grep -E 'FAILED|panicked' "$out/carve_device.log" | head -20 || true
        failed=1
    fi
    echo "=== train_digits on the simulated device and on CUDA (3 epochs)"
    for device in sim cuda; do
        if TRAIN_DIGITS_DATA="$dir/digits.csv.gz" "$dir/train_digits" --epochs 3 --device "$device" --json >"$out/train_digits_$device.log" 2>&1; then
            tail -1 "$out/train_digits_$device.log" | python3 -c 'import json, sys
j = json.loads(sys.stdin.read()); e = j["enabled"]
print(j["device"], "loss", e["final_loss"], "accuracy", e.get("test_accuracy"), "step us", e["iter_us_median"], "allocs", e.get("steady_state_allocs_max"))' || true
        else
            echo "FAILED: train_digits --device $device (see $out/train_digits_$device.log)"
            tail -3 "$out/train_digits_$device.log"
            [ "$device" = sim ] || [ "$gpu_visible" = 1 ] && failed=1
        fi
    done
    echo "=== train_gpt on CUDA (100 steps, planned) and PyTorch eager on the same GPU"
    if [ "$gpu_visible" = 1 ]; then
        TRAIN_GPT_DATA="$dir/shakespeare.txt.gz" "$dir/train_gpt" --iters 100 --eval-every 100 --sample 0 \
            --device cuda --workspace-mode planned --json >"$out/train_gpt_cuda.log" 2>"$out/train_gpt_cuda.err" \
            || { echo "FAILED: train_gpt --device cuda (see $out/train_gpt_cuda.err)"; tail -3 "$out/train_gpt_cuda.err"; failed=1; }
        TRAIN_DIGITS_DATA="$dir/digits.csv.gz" "$dir/train_digits" --epochs 3 --device cuda --workspace-mode planned \
            --json >"$out/train_digits_cuda_planned.log" 2>&1 || failed=1
        (cd "$dir" && python3 gpu_torch.py --iters 100) >"$out/torch_cuda.json" 2>"$out/torch_cuda.err" \
            || { echo "FAILED: gpu_torch.py (see $out/torch_cuda.err)"; tail -3 "$out/torch_cuda.err"; }
        python3 - "$out" <<'PY' || true
import json, os, sys
out = sys.argv[1]
def last(name):
    with open(os.path.join(out, name)) as f:
        return json.loads(f.read().strip().splitlines()[-1])
torch = last("torch_cuda.json")
gpt = last("train_gpt_cuda.log")
mlp = last("train_digits_cuda_planned.log")["planned"]
print("GPU:", torch["gpu"], "torch", torch["torch"], "cuda", torch["cuda"])
for name, carve_bytes, carve_ms, t in (
    ("mlp", mlp["device_bytes"], mlp["iter_us_median"] / 1e3, torch["mlp"]),
    ("gpt", gpt["device_bytes"], gpt["step_us_median"] / 1e3, torch["gpt"]),
):
    print(f"{name}: carve device bytes {carve_bytes:,} vs torch max_memory_reserved {t['max_memory_reserved']:,} "
          f"({carve_bytes / t['max_memory_reserved']:.3f}x); step {carve_ms:.3f} ms vs {t['step_ms_median']:.3f} ms "
          f"({carve_ms / t['step_ms_median']:.3f}x)")
print("gpt plan bytes", gpt.get("device_plan_bytes"), "lower bound", gpt.get("device_lower_bound_bytes"),
      "losses", gpt["train_loss"], gpt["val_loss"])
PY
    fi
    echo "logs in $out"
    [ "$failed" = 0 ] && echo "all GPU checks passed" || { echo "some GPU checks FAILED"; exit 1; }
}

case "$mode" in
    build) build ;;
    run) run "$@" ;;
    *) usage ;;
esac
