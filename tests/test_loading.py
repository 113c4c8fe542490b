"""Loading what users and others made: prompt rows, reward functions' outputs, models with their own code, checkpoints;
and the progress bar between evaluations. Real tiny models and subprocess runs, as a user runs the scripts."""

import json
import math
import os
import re
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

import ppo
import rloo
from conftest import assert_one_line_error, run_main, run_script

# ---- prompt rows: every row of a batch has the same keys (item 6) ------------------------------------------------

PROMPTS = textwrap.dedent('''
    def uneven(rng):
        a = rng.randrange(10)
        return {"prompt": f"{a}=", "answer": str(a)} if a % 2 == 0 else {"prompt": f"{a}="}  # the first row: even

    def exact(prompts, completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]
''')


@pytest.mark.parametrize("module", [ppo, rloo])
def test_check_rows_wants_the_same_keys_in_every_row(module):
    rows = [{"prompt": "1=", "answer": "1"}, {"prompt": "2=", "answer": "2"}]
    assert module.check_rows(rows, "my_prompts:fn") is rows
    with pytest.raises(SystemExit, match=r"^error: --prompt-fn 'my_prompts:fn': returned rows with different keys "
                                         r"\(\['answer', 'prompt'\] and \['prompt'\]\)"):
        module.check_rows([*rows, {"prompt": "3="}], "my_prompts:fn")
    with pytest.raises(SystemExit, match="'prompt' key"):
        module.check_rows([rows[0], "3="], "my_prompts:fn")


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_prompt_fn_rows_with_different_keys_stop_with_one_line(script, tmp_path):
    (tmp_path / "my_prompts.py").write_text(PROMPTS)
    result = run_main(script, "--prompt-fn", "my_prompts:uneven", "--reward-fn", "my_prompts:exact",
                      "--output-dir", tmp_path / "run", cwd=tmp_path)
    assert_one_line_error(result, "--prompt-fn", "different keys", "same keys in every row")


# ---- reward functions: None where a function does not apply, numpy numbers (item 9) -------------------------------


def reward_fn(values):
    """A reward function that returns fixed values, whatever the completions."""
    return lambda prompts, completions, **kwargs: list(values)


def call(module, fns, weights, **kwargs):
    """call_reward_fns on three completions."""
    fns = [(f"my_rewards:f{i}", fn) for i, fn in enumerate(fns)]
    return module.call_reward_fns(fns, weights, ["1=", "2=", "3="], ["1", "2", "3"], [[1], [2], [3]], {}, **kwargs)


@pytest.mark.parametrize("module", [ppo, rloo])
def test_reward_fns_may_return_none_and_numpy_numbers(module):
    only_some = reward_fn([None, np.float32(0.5), 2])
    others = reward_fn([np.float64(1.0), None, np.int64(-1)])
    flags = reward_fn([True, False, np.float16(0.25)])
    scores = call(module, [only_some, others, flags], [1.0, 2.0, 4.0])  # TRL: nansum of the weighted scores
    assert scores.tolist() == [2.0 + 4.0, 0.5 + 0.0, 2.0 - 2.0 + 1.0]
    assert call(module, [only_some], [1.0], reward_model=True).tolist() == [0.0, 0.5, 2.0]  # the RM scores the first


@pytest.mark.parametrize("module", [ppo, rloo])
def test_reward_fns_may_return_numpy_bools_and_0d_tensors(module):
    """TRL builds a tensor from the list, so a function written for it may return numpy bools (a comparison of numpy
    values) or 0-d tensors (a score computed with torch): both are taken, as the numbers they hold."""
    scores = call(module, [reward_fn([np.bool_(True), torch.tensor(0.5), torch.tensor(2, dtype=torch.int64)]),
                           reward_fn([np.bool_(False), torch.tensor(True), np.float32(1.0)])], [1.0, 2.0])
    assert scores.tolist() == [1.0, 0.5 + 2.0, 2.0 + 2.0]


@pytest.mark.parametrize("module", [ppo, rloo])
def test_reward_fns_still_refuse_what_is_not_a_finite_number(module):
    for bad, shown in [(math.nan, "nan"), (np.float32("inf"), "inf"), ("1.0", "'1.0'"),
                       ([1.0], r"\[1.0\]"), (torch.tensor([1.0]), r"tensor\(\[1\.\]\)"),
                       (torch.tensor(float("nan")), "nan")]:
        with pytest.raises(SystemExit, match=rf"^error: --reward-fn 'my_rewards:f0': returned {shown} for completion"
                                             " 1; return a finite number"):
            call(module, [reward_fn([1.0, bad, 1.0])], [1.0])


@pytest.mark.parametrize("module", [ppo, rloo])
def test_a_completion_no_function_scores_stops_the_run(module):
    with pytest.raises(SystemExit, match=r"^error: --reward-fn \['my_rewards:f0', 'my_rewards:f1'\]: every function "
                                         r"returned None for completion 2 \('3'\)"):
        call(module, [reward_fn([1.0, None, None]), reward_fn([None, 1.0, None])], [1.0, 1.0])


# ---- a reward model reads chat prompts as it was trained: through its own chat template --------------------------


@pytest.mark.parametrize("module", [ppo, rloo])
def test_a_reward_model_reads_the_conversation_through_its_own_chat_template(module):
    """With chat prompts, the reward model gets what TRL gives it: the prompt's messages and the completion as an
    assistant message, rendered with the reward model's chat template, its markers kept (here '1=' before a user
    turn, '2=' before an assistant one); with string prompts, the prompt's text and the completion's."""
    tokenizer = module.build_tokenizer()
    torch.manual_seed(0)
    policy = module.build_tiny_model(tokenizer)
    rm_tokenizer = module.build_tokenizer()
    rm_tokenizer.chat_template = ("{% for m in messages %}{{ '1' if m['role'] == 'user' else '2' }}={{ m['content'] }}"
                                  "\n{% endfor %}")
    config = policy.config
    config.num_labels = 1
    reward_model = LlamaForSequenceClassification(config).eval()
    seen = []
    reward_model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"]), with_kwargs=True)
    task = module.Task(module.TaskArgs(reward_model="rm"), None, [], reward_model=reward_model,
                       rm_tokenizer=rm_tokenizer)
    _, greedy = module.generation_configs(module.GenArgs(max_new_tokens=4), tokenizer, 1.0)
    for prompts in ([[{"role": "user", "content": "3+4="}], [{"role": "user", "content": "12+30="}]], ["5+5=", "1+2="]):
        out = module.rollout(policy, tokenizer, [{"prompt": p} for p in prompts], greedy, [], task)
        if isinstance(prompts[0], str):
            expected = rm_tokenizer([p + t for p, t in zip(prompts, out["texts"])], padding=True, padding_side="right")
        else:
            chats = [rm_tokenizer.apply_chat_template([*p, {"role": "assistant", "content": t}], tokenize=False)
                     for p, t in zip(prompts, out["texts"])]
            assert chats[0].startswith("1=3+4=\n2=")
            expected = rm_tokenizer(chats, add_special_tokens=False, padding=True, padding_side="right")
        assert seen.pop().tolist() == expected.input_ids


# ---- --trust-remote-code reaches the reward model and the PRM (item 8) ---------------------------------------------

REMOTE_CODE = textwrap.dedent('''
    """A model class that lives in the model's folder, as on the hub: loading it runs this file."""
    from transformers import (AutoModel, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                              LlamaForTokenClassification, LlamaModel)


    class RemoteConfig(LlamaConfig):
        model_type = "rlft_remote"


    class RemoteModel(LlamaModel):
        config_class = RemoteConfig


    AutoModel.register(RemoteConfig, RemoteModel, exist_ok=True)


    class RemoteForSequenceClassification(LlamaForSequenceClassification):
        config_class = RemoteConfig


    class RemoteForTokenClassification(LlamaForTokenClassification):
        config_class = RemoteConfig


    class RemoteForCausalLM(LlamaForCausalLM):
        config_class = RemoteConfig
''')


def remote_code_folder(path: Path, model_cls, num_labels: int = 0) -> Path:
    """A tiny Llama-shaped model (a causal LM, or a classifier of num_labels) with the built-in tokenizer, whose
    config.json names classes in a file beside it (auto_map), so that only trust_remote_code=True loads it."""
    tokenizer = ppo.build_tokenizer()
    config = ppo.build_tiny_model(tokenizer).config
    config.num_labels = num_labels or config.num_labels
    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "remote_llama.py").write_text(REMOTE_CODE)
    saved = json.loads((path / "config.json").read_text())
    saved.update(model_type="rlft_remote", auto_map={
        "AutoConfig": "remote_llama.RemoteConfig",
        "AutoModelForSequenceClassification": "remote_llama.RemoteForSequenceClassification",
        "AutoModelForTokenClassification": "remote_llama.RemoteForTokenClassification",
        "AutoModelForCausalLM": "remote_llama.RemoteForCausalLM"})
    (path / "config.json").write_text(json.dumps(saved))
    return path


@pytest.fixture(scope="module")
def remote_models(tmp_path_factory) -> dict:
    """A reward model and a PRM that need --trust-remote-code."""
    root = tmp_path_factory.mktemp("remote_code")
    return {"--reward-model": remote_code_folder(root / "rm", LlamaForSequenceClassification, 1),
            "--prm-model": remote_code_folder(root / "prm", LlamaForTokenClassification, 2)}


@pytest.mark.parametrize("script, prefix", [("ppo.py", ""), ("rloo.py", ""), ("interleave.py", "rloo.")])
def test_trust_remote_code_reaches_the_reward_model_and_the_prm(script, prefix, remote_models, tmp_path):
    flags = [f"--{prefix}prompt-fn", "ppo:addition_prompt", f"--{prefix}reward-model", remote_models["--reward-model"],
             f"--{prefix}prm-model", remote_models["--prm-model"]]
    tiny = ["--total-steps", "2", "--eval-every", "2", "--phases", "rloo", "--rloo.batch-size", "8"] \
        if script == "interleave.py" else ["--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2"]
    tiny += ["--max-new-tokens", "4"]
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers copies the model's code
    refused = run_script(script, *tiny, *flags, "--output-dir", tmp_path / "refused", env=env, timeout=300)
    line = assert_one_line_error(refused, "--", "pass --trust-remote-code")
    assert re.match(rf"error: --{re.escape(prefix)}(reward|prm)-model ", line), line  # interleave: the phase's flag
    result = run_script(script, *tiny, *flags, "--trust-remote-code", "--output-dir", tmp_path / "run", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "model" / "config.json").exists()


# ---- resuming reads a checkpoint's weights straight into the live model: models with their own code, models whose
# saved names differ from their live ones (Mixtral's experts), and a weight that is missing ------------------------

def mixtral_folder(path: Path) -> Path:
    """A tiny Mixtral: transformers keeps its experts fused in the live model and saves them one by one."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("script, model", [("ppo.py", "remote"), ("rloo.py", "remote"), ("rloo.py", "mixtral"),
                                           ("stepwise_prm.py", "remote")])
def test_a_resumed_run_of_a_model_with_its_own_code_or_renamed_weights_equals_the_run_left_alone(script, model,
                                                                                                 tmp_path):
    """--resume used to load each checkpoint folder with from_pretrained, without --trust-remote-code (a ValueError,
    or a prompt in a terminal) and through a second whole model."""
    if model == "mixtral":
        folder, flags = mixtral_folder(tmp_path / "mixtral"), []
    else:
        cls = LlamaForTokenClassification if script == "stepwise_prm.py" else LlamaForCausalLM
        folder, flags = remote_code_folder(tmp_path / "remote", cls, 2), ["--trust-remote-code"]
    tiny = RUNS[script] if script == "stepwise_prm.py" else [
        "--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2", "--max-new-tokens", "4"]
    tiny = [*tiny, "--model", folder, *flags, "--save-every", "1", "--keep-checkpoints", "0", "--eval-every", "1"]
    if script == "stepwise_prm.py":
        tiny += ["--total-steps", "2", "--learning-rate", "1e-3"]
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    full = run_script(script, *tiny, "--output-dir", tmp_path / "full", env=env)
    assert full.returncode == 0, full.stderr[-3000:]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "iter_000001",
                    tmp_path / "resumed" / "checkpoints" / "iter_000001")
    resumed = run_script(script, *tiny, "--output-dir", tmp_path / "resumed", "--resume", "latest", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("full", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_missing_a_weight_that_is_not_tied_stops_the_run(tmp_path):
    tokenizer = ppo.build_tokenizer()
    model = ppo.build_tiny_model(tokenizer)  # its output layer is tied to its embeddings: save_pretrained drops it
    model.save_pretrained(tmp_path / "policy")
    ppo.load_weights(model, tmp_path / "policy")  # the tied weight may be missing
    weights = load_file(tmp_path / "policy" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.0.mlp" not in k}, tmp_path / "policy" / "model.safetensors")
    with pytest.raises(SystemExit, match=r"^error: --resume .*missing \['model.layers.0.mlp"):
        ppo.load_weights(model, tmp_path / "policy")


# ---- checkpoints: state.pt holds plain data, read with weights_only=True (item 10); the bar between evaluations
# (item 12) ---------------------------------------------------------------------------------------------------------

RUNS = {
    "ppo.py": ["--total-episodes", "48", "--batch-size", "16", "--num-mini-batches", "2", "--num-ppo-epochs", "1"],
    "rloo.py": ["--total-episodes", "48", "--batch-size", "16", "--num-mini-batches", "2"],
    "stepwise_prm.py": ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "0", "--warmup-steps", "0",
                        "--total-steps", "3", "--batch-size", "16"],
    "interleave.py": ["--total-steps", "3", "--sft.batch-size", "8", "--rloo.batch-size", "8"],
}
SAVE = ["--eval-every", "3", "--save-every", "1", "--keep-checkpoints", "0"]  # 3 iterations, evaluated at 0 and 3
SHOWN = {"ppo.py": ("acc", "task/accuracy"), "rloo.py": ("acc", "task/accuracy"),
         "stepwise_prm.py": ("f1", "eval/wrong_step_f1"), "interleave.py": ("acc", "task/accuracy")}


@pytest.fixture(scope="module", params=list(RUNS))
def saved_run(request, tmp_path_factory) -> tuple[str, Path, str]:
    """A short run of each script that writes a checkpoint after every iteration: (script, run folder, stderr)."""
    script = request.param
    out = tmp_path_factory.mktemp(script.removesuffix(".py")) / "run"
    result = run_main(script, *RUNS[script], *SAVE, "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return script, out, result.stderr


def bar_values(stderr: str, key: str) -> list[str]:
    """The values of `key` that the tqdm bar showed, in order (its text in stderr, redrawn after each '\\r'). Each
    iteration's set_postfix redraws it; tqdm redraws it at other times too, with the postfix it has."""
    return re.findall(rf"\b{key}=([^,\]]*)[,\]]", stderr)


def test_the_progress_bar_shows_the_last_evaluation_between_evaluations(saved_run):
    script, out, stderr = saved_run
    key, metric = SHOWN[script]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = f"{rows[0][metric]:.3f}", f"{rows[-1][metric]:.3f}"
    shown = bar_values(stderr, key)  # iterations 1 and 2 show the first evaluation's value, 3 and the end the last
    assert shown[0] == first and shown[-1] == last and set(shown) == {first, last}, shown


def resumable_copy(out: Path, tmp_path: Path) -> Path:
    """A run folder holding the first checkpoint of `out` and the metrics rows written before it."""
    copy = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "iter_000001", copy / "checkpoints" / "iter_000001")
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines() if json.loads(line)["iteration"] < 2]
    (copy / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))
    return copy


class RunsCode:
    """What a malicious state.pt can hold: unpickling it calls os.system (here: creates a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_resume_refuses_a_state_that_would_run_code(saved_run, tmp_path):
    script, out, _ = saved_run
    state_file = out / "checkpoints" / "iter_000001" / "state.pt"
    state = torch.load(state_file, weights_only=False)  # this test's own file: trusted
    copy = resumable_copy(out, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save({**state, "note": RunsCode(marker)}, copy / "checkpoints" / "iter_000001" / "state.pt")
    result = run_script(script, *RUNS[script], *SAVE, "--output-dir", copy, "--resume", "latest", timeout=300)
    assert_one_line_error(result, "--resume", "iter_000001", "posix.system", "could run code: refused")
    assert not marker.exists()
    torch.load(state_file, weights_only=True)  # what the script itself writes is plain data, as --resume reads it


@pytest.mark.parametrize("saved_run", ["ppo.py", "stepwise_prm.py"], indirect=True)
def test_a_resumed_run_shows_the_last_evaluation_before_its_own(saved_run, tmp_path):
    script, out, _ = saved_run
    copy = resumable_copy(out, tmp_path)
    result = run_script(script, *RUNS[script], *SAVE, "--output-dir", copy, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    key, metric = SHOWN[script]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shown = bar_values(result.stderr, key)
    assert shown[0] == f"{rows[0][metric]:.3f}", shown  # iteration 2, before its own evaluation
