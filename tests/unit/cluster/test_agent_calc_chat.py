"""The calculator agent for a chat model (configs/smollm2_agent_calc.yaml): worded prompts and hermes calls in
cluster/data/agent_calc.py, and warm-start demonstrations laid out through the chat template as the agent loop
lays out an episode (cluster/driver/warm_start.py: demonstration(chat=True), episode_prompt_ids, demo_layout)."""

from __future__ import annotations

import pytest

from cluster.data.agent_calc import agent_calc_rows, calc_turns
from cluster.driver.warm_start import demo_layout, demonstration, episode_prompt_ids
from rollout.chat_delta import TurnEnd, chat_delta_ids
from rollout.contracts import PromptRow
from rollout.tool_calls import parse
from tests.helpers import REPO_ROOT
from tests.helpers.chat_tokenizers import CALC_TOOL, build_bpe_tokenizer

# SmolLM2-135M-Instruct's own template (models/smollm2-135m-instruct, `make real-model`): ChatML with a default
# system prompt, any role rendered as it is, no tools section.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
TEMPLATE = ('What is {expression}? Use the calculator: call it as <tool_call>{{"name": "calc", "arguments": '
            '{{"expression": "..."}}}}</tool_call>, then answer with its result.')


def test_worded_prompts_and_hermes_calls_leave_the_tag_rows_as_they_were():
    tag_train, tag_held = agent_calc_rows(lambda s: [len(s)], num_terms=3, num_train=20, num_eval=5, seed=7,
                                          demo_slip_rate=0.5)
    train, held = agent_calc_rows(lambda s: [len(s)], num_terms=3, num_train=20, num_eval=5, seed=7,
                                  demo_slip_rate=0.5, prompt_template=TEMPLATE, tool_format="hermes")
    assert [r.uid for r in train + held] == [r.uid for r in tag_train + tag_held]  # the same problems and slips
    assert tag_train[0].prompt == tag_train[0].meta["expression"] + "="
    expression = train[0].meta["expression"]
    assert train[0].prompt.startswith(f"What is {expression}? Use the calculator: call it as <tool_call>{{\"name\"")
    assert train[0].answer == tag_train[0].answer and train[0].prompt_token_ids == [len(train[0].prompt)]
    for tag_row, row in zip(tag_train, train):
        (_, tag_call), tool, answer = tag_row.meta["solution_turns"]
        (_, call), tool2, answer2 = row.meta["solution_turns"]
        parsed = parse("hermes", call)
        assert not parsed.errors and [(c.name, c.arguments) for c in parsed.calls] == [
            ("calc", {"expression": tag_call[len("<call>calc "):-len("</call>")]})]
        assert (tool, answer) == (tool2, answer2)
    assert calc_turns([12, 34, 56], slip=True, tool_format="hermes")[0] == [
        "assistant", '<tool_call>{"name": "calc", "arguments": {"expression": "12+34"}}</tool_call>']
    with pytest.raises(ValueError, match="fills in only"):
        agent_calc_rows(lambda s: [1], num_terms=3, num_train=1, num_eval=1, seed=0, prompt_template="{question}")
    with pytest.raises(ValueError, match="not 'json'"):
        agent_calc_rows(lambda s: [1], num_terms=3, num_train=1, num_eval=1, seed=0, tool_format="json")


@pytest.mark.parametrize("template", [None, SMOLLM2_TEMPLATE], ids=["chatml_with_tools", "smollm2"])
def test_a_chat_demonstration_is_the_episode_the_loop_would_build(template):
    tok = build_bpe_tokenizer() if template is None else build_bpe_tokenizer(template, name="smollm2-like")
    tools = [CALC_TOOL]
    turns = calc_turns([12, 34, 56], tool_format="hermes")
    row = PromptRow("t", "What is 12+34+56?", [0], "102", meta={"solution_turns": turns})
    prompt = episode_prompt_ids(row, tok, tools)
    ids, mask = demonstration(row, tok, chat=True, tools=tools, tool_format="hermes")
    # the loop: first ids, the call sampled up to its stop string, the reply as the delta after a "stop" turn
    # (the tool message named after the call), the answer sampled up to EOS
    assert prompt == tok.apply_chat_template([{"role": "user", "content": row.prompt}], tools=tools,
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    call = tok(turns[0][1], add_special_tokens=False)["input_ids"]
    reply = chat_delta_ids(tok, tools, [{"role": "tool", "name": "calc", "content": "102"}], TurnEnd("stop"))
    answer = tok("102", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == call + reply + answer and mask == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
    # and the same text as the template's rendering of the whole conversation, up to its last turn's closing
    conversation = [{"role": "user", "content": row.prompt}, {"role": "assistant", "content": turns[0][1]},
                    {"role": "tool", "name": "calc", "content": "102"}, {"role": "assistant", "content": "102"}]
    whole = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert whole.rstrip("\n") == tok.decode(prompt + ids, skip_special_tokens=False)
    assert ("Tools:" in whole) == (template is None)  # SmolLM2's template never shows the tools' schemas


def test_a_chat_turn_without_a_call_ends_on_eos_before_its_reply():
    tok = build_bpe_tokenizer()
    row = PromptRow("t", "Guess.", [0], "7", meta={"solution_turns": [["assistant", "5"], ["user", "higher"],
                                                                     ["assistant", "7"]]})
    ids, mask = demonstration(row, tok, chat=True, tools=None, tool_format="hermes")
    eos = tok.eos_token_id
    five = tok("5", add_special_tokens=False)["input_ids"] + [eos]
    reply = chat_delta_ids(tok, None, [{"role": "user", "content": "higher"}], TurnEnd("eos", eos))
    assert ids[:len(five) + len(reply)] == five + reply and mask[:len(five)] == [1] * len(five)
    assert tok.decode(reply, skip_special_tokens=False).startswith("\n<|im_start|>user\nhigher")
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        demonstration(PromptRow("t", "x", [0], "7", meta={"solution_turns": [["tool", "1"]]}), tok, chat=True)


def test_the_warm_start_lays_out_chat_demonstrations_for_env_tools_only():
    from cluster.config import load_config
    from cluster.models.tiny_model import build_char_tokenizer

    cfg = load_config(REPO_ROOT / "configs" / "smollm2_agent_calc.yaml")
    layout = demo_layout(cfg, build_bpe_tokenizer())
    assert layout["chat"] and layout["tool_format"] == "hermes"
    assert [t["function"]["name"] for t in layout["tools"]] == ["calc"]
    assert layout["tools"][0]["function"]["parameters"]["required"] == ["expression"]
    assert demo_layout(cfg, build_char_tokenizer()) is None  # no template: plain mode, as before
    assert demo_layout(load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml"), build_char_tokenizer()) is None
    guess = load_config(REPO_ROOT / "configs" / "smollm2_agent_calc.yaml",
                        ["env.tools=[]", "env.cls=reward.envs.guess_number:GuessNumber"])
    with pytest.raises(ValueError, match="env.tools episodes only"):
        demo_layout(guess, build_bpe_tokenizer())
    openenv = load_config(REPO_ROOT / "configs" / "smollm2_agent_calc.yaml",
                          ["env.tools=[]", "env.openenv.app=reward.envs.openenv_guess:app"])
    with pytest.raises(ValueError, match="with env.openenv and a chat template.*set warm_start.steps=0"):
        demo_layout(openenv, build_bpe_tokenizer())
    assert demo_layout(load_config(REPO_ROOT / "configs" / "tiny_openenv_guess.yaml"), build_char_tokenizer()) is None


@pytest.mark.skipif(not (SMOLLM2_DIR / "tokenizer_config.json").is_file(), reason="make real-model not run")
def test_smollm2s_own_template_is_prefix_stable_and_ignores_tools():
    from transformers import AutoTokenizer

    from cluster.driver.episodes import check_template

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    assert tok.chat_template == SMOLLM2_TEMPLATE
    check_template(tok)
    text = tok.decode(chat_delta_ids(tok, [CALC_TOOL], [{"role": "tool", "name": "calc", "content": "102"}],
                                     TurnEnd("stop")), skip_special_tokens=False)
    assert text == "<|im_end|>\n<|im_start|>tool\n102<|im_end|>\n<|im_start|>assistant\n"
