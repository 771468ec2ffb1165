"""The documentation stays true: its snippets run, its numbers and files exist, its references resolve.

* Every Python block of README.md and docs/ runs as a file under ``torchrun --nproc_per_node 2`` (CPU,
  gloo), in order (``MODEL`` a tiny saved Llama, ``OUT`` a temporary directory, ``dataset`` /
  ``text_dataset`` / ``loader`` small data); a model a block leaves behind must hold the same weights on
  both ranks (the gradient sync of the custom loop).
* Every CPU shell block runs as written in a tree that links the repository (fine-tune commands get a
  2-step budget appended); blocks that need GPUs have their fine-tune commands validated with ``--check``.
* Every block carries a marker when it does not run here (tests/doc_snippets.py says which).
* The YAML reference is the one scripts/gen_config_reference.py writes from the schema, and every dotted
  key the pages name exists in the schema.
* Every results file the pages name exists; the README's headline ratios equal the results files'; the
  schedule table of docs/design.md is the script's output; each error message docs/troubleshooting.md
  quotes is in the library.
* The repository describes the project as it is: none of the narrative phrases in ``HISTORY``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import NOT_RUN_REASONS, ROOT, all_snippets, commands, doc_pages, split_command

from lightseq_hf._testing.faults import ENV as FAULTS_ENV

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
FAST = {"training.max_steps=": "training.max_steps=2", "eval_samples=": "data.synthetic.eval_samples=2",
        "progress_bar=": "logging.progress_bar=false"}
TRAINING_ENTRIES = ("scripts/finetune.py", "lightseq-finetune", "scripts/run_tiny.sh")
NO_TRAINING_FLAGS = ("--check", "--print-config", "--plan")


def _cpu_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep))
    env.pop(FAULTS_ENV, None)  # no injected faults in documented runs
    env.update(extra or {})
    return env


# ----------------------------------------------------------------------------- markers


def test_every_block_runs_or_says_why_not():
    blocks = all_snippets()
    assert len(blocks) > 10, "no code blocks found in the documentation"
    bad = [f"{s.where}: marker {s.marker!r}" for s in blocks
           if s.marker not in (None, "gpu-only", "multinode-demo", "not-run")]
    bad += [f"{s.where}: not-run reason {s.reason!r} (allowed: {sorted(NOT_RUN_REASONS)})"
            for s in blocks if s.marker == "not-run" and s.reason not in NOT_RUN_REASONS]
    bad += [f"{s.where}: a marker takes no reason" for s in blocks
            if s.marker in ("gpu-only", "multinode-demo") and s.reason]
    assert not bad, "\n".join(bad)
    demos = [s for s in blocks if s.marker == "multinode-demo"]
    assert len(demos) == 1 and demos[0].lang == "bash", "one multinode-demo block (tests/test_multinode.py)"


# ----------------------------------------------------------------------------- Python blocks


def _tiny_model(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(128)}, unk_token="t2"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2",
                            bos_token="t3").save_pretrained(path)


@pytest.mark.slow
def test_python_blocks_run_as_files_under_torchrun(tmp_path):
    """Each block, as a file, under ``torchrun --nproc_per_node 2`` (tests/doc_runner.py: one launch, the
    process reset between files); a model a block leaves holds the same weights on both ranks."""
    blocks = [s for s in all_snippets() if s.lang == "python" and s.marker is None]
    assert len(blocks) >= 8, [s.where for s in blocks]
    files = tmp_path / "snippets"
    files.mkdir()
    names = {}
    for i, block in enumerate(blocks):
        name = f"{i:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", block.where).strip("-") + ".py"
        (files / name).write_text(block.code)
        names[name] = block.where
    _tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "doc_runner.py"), str(files), str(tmp_path / "model"), str(out)]
    proc = subprocess.run(command, cwd=tmp_path, env=_cpu_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    failures = [f"rank {r}, {names[name]} raised:\n{res['error']}" for r, results in enumerate(ranks)
                for name, res in results.items() if res["error"]]
    for name in names:
        for key in ("weights", "logits"):  # the custom loop's gradient sync keeps the replicas equal
            values = [results[name].get(key) for results in ranks]
            if values[0] is not None and values[0] != pytest.approx(values[1], rel=1e-9, abs=1e-12):
                failures.append(f"{names[name]}: the {key}' sum differs between ranks: {values}")
    assert not failures, "\n\n".join(failures)
    print("\n".join(f"{names[n]}: {r['seconds']}s" for n, r in ranks[0].items()))


def test_gpu_only_python_blocks_compile():
    for s in all_snippets():
        if s.lang == "python" and s.marker == "gpu-only":
            compile(s.code, s.where, "exec")


# ----------------------------------------------------------------------------- shell blocks


def _linked_tree(root: Path) -> Path:
    """A directory that looks like a fresh clone after ``scripts/setup_env.sh``, without installing."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("configs", "scripts", "examples", "lightseq_hf", "tests", "benchmarks", "docs", "README.md",
                 "pyproject.toml", "constraints.txt"):
        (root / name).symlink_to(ROOT / name)
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    (venv / "activate").write_text(f'export PATH="{venv}:{Path(sys.executable).parent}:$PATH"\n')
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes())
    digest = digest.hexdigest()
    (root / ".venv" / ".lightseq-installed").write_text(f"{digest} {sys.version.split()[0]}\n")
    return root


def _with_budget(command: str) -> str:
    """The command without its trailing comment; a training run gets a small budget appended."""
    tokens = split_command(command)
    if not any(e in command for e in TRAINING_ENTRIES) or any(f in tokens for f in NO_TRAINING_FLAGS):
        return shlex.join(tokens)
    return shlex.join([*tokens, *(v for k, v in FAST.items() if not any(k in t for t in tokens))])


def _cpu_shell_pages() -> dict[Path, list]:
    pages: dict[Path, list] = {}
    for s in all_snippets():
        if s.lang == "bash" and s.marker is None:
            pages.setdefault(s.path, []).append(s)
    return pages


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT).as_posix() for p in _cpu_shell_pages()))
def test_shell_blocks_run_on_the_cpu(page, tmp_path):
    """A page's CPU blocks, in order, in one linked tree (a later block may use an earlier one's run)."""
    tree = _linked_tree(tmp_path / "clone")
    env = _cpu_env({"PATH": f"{tree / '.venv' / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"})
    for block in _cpu_shell_pages()[ROOT / page]:
        script = "set -euo pipefail\n" + "\n".join(_with_budget(c) for c in commands(block.code)) + "\n"
        proc = subprocess.run(["bash", "-c", script], cwd=tree, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{block.where}:\n{script}\n{(proc.stdout + proc.stderr)[-6000:]}"


def _world_size(tokens: list[str]) -> int:
    def value(flag: str) -> str | None:
        return tokens[tokens.index(flag) + 1] if flag in tokens else None

    if value("--num_processes"):
        return int(value("--num_processes"))
    if value("--nproc_per_node"):
        return int(value("--nproc_per_node")) * int(value("--nnodes") or 1)
    if value("--config_file"):
        import yaml

        return int(yaml.safe_load((ROOT / value("--config_file")).read_text())["num_processes"])
    return 1


def test_gpu_commands_name_valid_configs(tmp_path, monkeypatch, capsys):
    """Each documented GPU fine-tune command passes ``--check`` for the world it launches."""
    from lightseq_hf.training.cli import main

    monkeypatch.chdir(_linked_tree(tmp_path / "clone"))
    checked = 0
    for s in all_snippets():
        if s.lang != "bash" or s.marker not in ("gpu-only", "multinode-demo"):
            continue
        for command in commands(s.code):
            tokens = split_command(command)
            entry = next((i for i, t in enumerate(tokens) if t.endswith("finetune.py")
                          or t == "lightseq-finetune"), None)
            if entry is None:
                continue
            args = [t for t in tokens[entry + 1:]]
            world = _world_size(tokens[:entry])
            code = main([*args, f"output_dir={tmp_path / 'out'}", "--check", "--world-size", str(world)])
            assert code == 0, f"{s.where}: {command}\n{capsys.readouterr().err}"
            checked += 1
    assert checked >= 5, checked


# ----------------------------------------------------------------------------- README shape


def test_readme_shape():
    lines = README.read_text().splitlines()
    assert len(lines) <= 280, f"README.md has {len(lines)} lines (at most 280)"
    start = next(i for i, line in enumerate(lines) if line.startswith("| | **lightseq_hf**"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert end <= 80, f"the comparison table ends at line {end} (within the first 80)"
    text = "\n".join(lines)
    for peer in ("torch context parallel", "DeepSpeed Ulysses", "ring-flash-attention", "Ringmaster"):
        assert peer in lines[start], peer
    supported = text.index("### Supported models")
    assert supported < text.index("<!-- support-table:start -->") < text.index("<!-- support-table:end -->")
    assert "<!-- clients table -->" in text
    fences = [s for s in all_snippets() if s.path == README and s.lang == "bash"]
    first = [split_command(commands(s.code)[0]) for s in fences if s.marker is None]
    assert ["bash", "scripts/run_tiny.sh"] in first, "the README's main job, run by this test"
    test_command = [["bash", "scripts/test.sh"]]
    assert any([split_command(c) for c in commands(s.code)] == test_command for s in fences), \
        "the README's test command"
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(), "CI runs the README's test command"


def test_the_quick_start_says_what_it_runs_and_how_long_it_took():
    """run_tiny.sh's command without GPUs is the one configs/tiny.yaml and the benchmarks page quote, and
    the durations they and the README give are the measured ones (results/quickstart-cpu-*.json)."""
    script = (ROOT / "scripts" / "run_tiny.sh").read_text().splitlines()
    (cpu,) = [line for line in script if line.startswith("exec ") and "training.device=cpu" in line]
    command = cpu.removeprefix("exec ").replace(' "$@"', "")
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    tiny_section = " ".join(bench[bench.index("## The tiny CPU run"):].split("\n## ")[0].split())
    assert f"(`{command}`)" in tiny_section and "accelerate launch" not in tiny_section
    header = " ".join(line.lstrip("# ") for line in (ROOT / "configs" / "tiny.yaml").read_text().splitlines()
                      if line.startswith("#"))
    assert command in header and "accelerate" not in header
    (timings,) = sorted(RESULTS.glob("quickstart-cpu-*.json"))
    record = json.loads(timings.read_text())
    tiny = record["run_tiny"]
    assert tiny["runs"] == command and tiny["summary"] in tiny_section
    took = f"{tiny['wall_s'] / 60:.0f} minutes"
    cpu_time = f"{tiny['cpu_s'] / 60:.0f} minutes of CPU time"
    readme = " ".join(README.read_text().split())
    assert f"`run_tiny.sh` took {took} ({cpu_time})" in readme and record["date"] in readme
    assert f"Took {took} on a 2-core machine shared with other jobs, {cpu_time}" in header
    assert f"{tiny['wall_s']:.0f} s ({took})" in tiny_section
    assert f"{tiny['cpu_s']:.0f} s of CPU time" in tiny_section
    suite = record["test_sh"]
    assert f"`test.sh`'s pytest run took {suite['pytest_s'] / 60:.0f} minutes" in readme


def _summary(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())["summary"]


def _rows(name: str) -> list[dict]:
    return json.loads((RESULTS / name).read_text())["rows"]


def _four_gpu_gain_split() -> tuple[float, float]:
    """Of the 4-GPU 128K step's gain over torch context parallel, the checkpointing share (torch CP's HF
    checkpointing reruns the attention forward; remat does not) and the attention share (our forward and
    backward against torch CP's), from the attention benchmark of the same machine, 32 layers."""
    def ms(impl: str, phase: str) -> float:
        return next(r["ms"] for r in _rows("dist-h100-x4-2026-11-26.json")
                    if r.get("seq") == 131072 and r.get("heads") == r.get("kv_heads") == 32
                    and r["impl"] == impl and r["phase"] == phase)
    rerun = ms("torch_cp_allgather_cudnn", "fwd")
    faster = ms("torch_cp_allgather_cudnn", "fwd_bwd") - ms("ours_sdpa_cudnn", "fwd_bwd")
    return rerun / (rerun + faster), faster / (rerun + faster)


def test_readme_headline_numbers_come_from_results_files():
    from dataclasses import replace

    from lightseq_hf.planner import GIB, plan_memory
    from lightseq_hf.training.config import load_config
    from lightseq_hf.training.planning import plan_inputs

    text = " ".join(README.read_text().split())
    x2, x4 = _summary("train-h200-x2-2026-11-22.json"), _summary("train-h100-x4-2026-11-26-128k.json")
    packed, dist = _summary("packed-h100-x2-2026-11-26.json"), _summary("dist-h100-x4-2026-11-26.json")
    (ft,) = json.loads((RESULTS / "finetune-h100-x4-2026-11-26.json").read_text())["rows"]
    per_token = _summary("bytes-per-token-h100-x1-2026-11-26-8b.json")
    ladder = _summary("maxctx-h100-x2-2026-11-26.json")
    long_rows = _summary("bytes-per-token-h100-x1-2026-11-26-8b-4-layers.json")
    checkpointing, attention = _four_gpu_gain_split()
    assert 0.75 <= checkpointing <= 0.85 and "four fifths of the 4-GPU gain is checkpointing" in text
    assert 0.15 <= attention <= 0.25 and "one fifth the faster distributed attention" in text
    shape, opts = plan_inputs(load_config(ROOT / "configs" / "llama3-8b-256k-4gpu.yaml"), 4, "fsdp")
    # offload auto: the run's log says the planner chose 0 of 32 layers on the 80 GB cards
    log = (RESULTS / "raw" / "h100-x4-2026-11-26" / "8b-256k.log").read_text()
    assert "auto: 0 of 32 layers offloaded" in log
    planned = plan_memory(shape, replace(opts, offload_checkpoints=False)).peak_gpu / GIB
    measured = max(ft["peak_mem_gib_per_rank"])
    assert abs(planned - measured) <= 0.05 * measured and f"{measured:.1f} GiB per GPU as the planner" in text
    peers, two_gpus = _summary("peers-h200-x4-2026-11-28.json"), _summary("peers-h200-x2-2026-11-28.json")
    vs_alst = peers["vs_alst"]["8b"]
    expected = [
        f"Training step {vs_alst['131072']:.2f}x faster than ALST",
        f"{peers['vs_torch_cp']['8b']['131072']:.2f}x faster than torch context parallel, Llama-3.1-8B at "
        "128K tokens on 4 x H200",
        f"{vs_alst['65536']:.2f}x / {vs_alst['262144']:.2f}x ALST at 64K / 256K, "
        f"{two_gpus['vs_alst']['8b']['131072']:.2f}x at 128K on 2 x H200",
        f"{x4['vs_torch_cp_128k']:.2f}x faster than torch context parallel",
        f"{x2['vs_torch_cp_64k']:.2f}x / {x2['vs_torch_cp_128k']:.2f}x at 64K / 128K on 2 x H200",
        f"{x2['remat_vs_hf_ckpt_32k_per_gpu']:.2f}x faster per step than Hugging Face's",
        f"{ft['step_s']:.1f} s a step",
        f"{long_rows['device_bytes_per_token'] / 1024:.1f} KB per token on the device at 512K",
        f"({per_token['device_bytes_per_token'] / 1024:.1f} KB at 128K tokens)",
        f"{per_token['host_bytes_per_token'] / 1024:.0f} KB on the host",
        f"{packed['packed_vs_unpacked_64k']:.1f}x faster than the same tokens",
        f"{packed['per_seq']['65536']['torch_cp_over_packed']:.1f}x faster than torch context parallel,",
        f"{packed['ring_speedup_vs_triton_64k']:.2f}x faster than our Triton kernels",
        f"Llama-3.1-8B at {ladder['max_context_ours'] // 1024}K tokens on 2 x H100 80 GB, a full AdamW step",
        f"{ladder['max_context_ratio']:.2f}x the longest torch context parallel trained in the same run "
        f"({ladder['max_context_torch_cp'] // 1024}K; its host ran out at "
        f"{ladder['first_failed_context_torch_cp'] // 1024}K)",
        f"Llama-2-7B: {_summary('maxctx-h200-x2-2026-11-22.json')['max_context_ours'] // 1024}K on 2 x H200",
        f"{per_token['device_bytes_per_token'] / 1024:.1f} KB of device memory per token at 128K tokens",
        f"{dist['per_seq']['32768']['comm_overhead']:.1%} / {dist['per_seq']['65536']['comm_overhead']:.1%}"
        " of the attention step at 32K / 64K",
        f"{_summary('finetune-h200-x2-2026-11-22.json')['tokens_per_s']['7b-64k']:.0f} tokens/s "
        f"({_summary('finetune-h200-x2-2026-11-22.json')['vs_bench_train']['7b-64k']:.3f}x",
    ]
    assert packed["exact"]
    missing = [e for e in expected if e not in text]
    assert not missing, f"README headline numbers not found (recompute from the results files): {missing}"


def test_headline_plot_draws_from_the_results(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plot_headline
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    ratios = dict(plot_headline.training_ratios())
    want = _summary("train-h200-x2-2026-11-22.json")["vs_torch_cp_128k"]
    assert ratios["128K\n2 x H200"] == pytest.approx(want)
    plot_headline.plot(tmp_path / "headline.png")
    assert (tmp_path / "headline.png").stat().st_size > 10_000
    assert (ROOT / "benchmarks" / "headline.png").is_file()


# ----------------------------------------------------------------------------- files, links, keys


RESULT_NAME = re.compile(r"[\w.{},*/-]+\.(?:json\.gz|jsonl|json|log|png)\b")


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for part in m.group(1).split(",") for x in _expand(name[:m.start()] + part + name[m.end():])]


def test_every_results_file_the_docs_name_exists():
    missing, named = [], 0
    for page in doc_pages():
        for name in set(RESULT_NAME.findall(page.read_text())):
            if name.startswith("-") or "<" in name or name in ("metrics.jsonl", "summary.json", "loss.png",
                                                                "checkpoint_complete.json", "config.json"):
                continue  # a shortened name next to its full link, or a run's output file
            for candidate in _expand(name):
                base = Path(candidate.replace("results/", "", 1) if candidate.startswith("results/") else
                            candidate)
                found = (list(RESULTS.glob(str(base))) or list(RESULTS.rglob(base.name)) or
                         list(ROOT.glob(candidate)) or list((page.parent).glob(candidate)))
                named += 1
                if not found:
                    missing.append(f"{page.relative_to(ROOT)}: {candidate}")
    assert named >= 20, named
    assert not missing, "\n".join(missing)


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def test_links_between_pages_resolve():
    bad = []
    for page in doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not bad, "\n".join(bad)


def test_config_reference_is_generated_from_the_schema():
    proc = subprocess.run([sys.executable, "scripts/gen_config_reference.py", "--check"], cwd=ROOT,
                          env=_cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    undocumented = [line for line in (ROOT / "docs" / "config-reference.md").read_text().splitlines()
                    if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not undocumented, f"keys without a description (give one in config.py): {undocumented}"


def _schema_has(dotted: str) -> bool:
    from pydantic import BaseModel

    from lightseq_hf.training.config import FinetuneConfig

    cls = FinetuneConfig
    for part in dotted.split("."):
        field = cls.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return True  # a leaf, or a free mapping such as model.config
        cls = ann
    return True


def test_dotted_keys_in_the_docs_exist_in_the_schema():
    sections = "training|saving|data|logging|model"
    key = re.compile(rf"(?<![\w.])((?:{sections})\.[a-z_]+(?:\.[a-z_]+)*)(?=[\s`:=,)]|$)")
    unknown = set()
    for page in doc_pages():
        text = page.read_text()
        spans = re.findall(r"`([^`\n]+)`", text)
        spans += [t for s in all_snippets() if s.path == page and s.lang == "bash"
                  for c in commands(s.code) for t in split_command(c) if "=" in t]
        for span in spans:
            for name in key.findall(span.strip()):
                if name.endswith((".py", ".md", ".yaml", ".json")):
                    continue  # a file name
                if name.startswith("model.") and ("(" in span or name.split(".")[1] not in
                                                  ("path", "config", "random_init", "dtype")):
                    continue  # Python attribute access such as model.config.vocab_size
                if not _schema_has(name.split("=")[0]):
                    unknown.add(f"{page.relative_to(ROOT)}: {name}")
    assert not unknown, sorted(unknown)


def test_design_schedule_table_is_the_scripts_output():
    proc = subprocess.run([sys.executable, "scripts/schedule_table.py"], cwd=ROOT, env=_cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    produced = set(proc.stdout.splitlines())
    text = (ROOT / "docs" / "design.md").read_text()
    after = text.split("| P | ring (Alg. 1)")[1].splitlines()[2:]
    table = after[:next(i for i, line in enumerate(after) if not line.startswith("|"))]
    assert len(table) >= 4 and all(line in produced for line in table), table


def _library_strings() -> list[str]:
    """Every string literal of the library, f-strings with their fields as ``{}``."""
    out = []
    for path in (ROOT / "lightseq_hf").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return out


def test_troubleshooting_quotes_real_messages():
    strings = _library_strings()
    headings = re.findall(r"^### (.*)$", (ROOT / "docs" / "troubleshooting.md").read_text(), flags=re.M)
    quoted = [q for h in headings for q in re.findall(r"`([^`]+)`", h)]
    assert len(quoted) >= 20, quoted
    missing = [q for q in quoted if not any(q in s for s in strings)]
    assert not missing, f"messages quoted in docs/troubleshooting.md but not in lightseq_hf: {missing}"


# ----------------------------------------------------------------------------- no development history

HISTORY = [
    r"\bsessions?\b",
    r"\bissue\s*#?\d+",
    r"\b(before|after) (this|the) fix\b",
    r"\blent (GPUs?|images?|machines?)\b",
    r"\bthe lent\b",
    r"\bold\s+objective\b",
    r"\bas before\b",
    r"\bpreviously\b",
    r"\b(not|was|were) re-?run\b",
    r"\bre-?run here\b",
    r"\ban earlier (run|session|version|measurement)\b",
    r"\bthe earlier run\b",
    r"\bthe previous run\b(?! \(nothing)",
    r"\bthis (README|session)'s\b",
    r"\bcommit [0-9a-f]{7,}\b",
    r"\bthe old `",
    r"\bnow counts\b",
    r"\bpast one device call\b",
]
#: (path, regex) pairs where a word is used for what it says, not as history
ALLOWED = {
    ("tests/test_docs.py", None),  # the list above
    ("lightseq_hf/training/loop.py", r"\ban earlier (run|session|version|measurement)\b"),  # the user's run
}


def _tracked(paths: list[str]) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True).stdout
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def _history_hits(files: list[Path]) -> list[str]:
    hits = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if (rel, None) in ALLOWED or path.suffix in (".png", ".gz"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in HISTORY:
                if re.search(pattern, line, flags=re.I) and (rel, pattern) not in ALLOWED:
                    hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    return hits


def test_no_development_history_in_the_docs():
    files = [README, *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
    hits = _history_hits(files)
    assert not hits, "\n".join(hits)


def test_no_development_history_in_code_tests_and_configs():
    hits = _history_hits(_tracked(["lightseq_hf", "scripts", "tests", "configs", "examples", ".ci",
                                   "pyproject.toml", "constraints.txt", "benchmarks/results/*.json"]))
    assert not hits, "\n".join(hits)
