"""Test fixtures of `dflash data prepare`: small BPE tokenizers (trained here with `tokenizers` on a
few sentences) saved next to a tokenizer_config.json that carries a real model's chat template
(tests/data_prepare/templates/*.jinja) and the special tokens that template uses."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Speculative decoding drafts several tokens and verifies them with the target model.",
    "Please write a short poem about the sea, the wind and the stars.",
    "def add(a, b):\n    return a + b\n",
    "Let me think step by step. First, two plus two is four.",
    "Tool calls: get_weather(city) returns the temperature in Celsius.",
    "Bonjour, comment allez-vous? Très bien, merci. Ça va?",
    "Numbers 0123456789 and symbols {}[]()<>:;,.!?\"'/\\|-_=+*&^%$#@~`",
]

# name -> (template file, where the template is stored, special tokens, extra added tokens, config)
TEMPLATES = {
    "qwen3": ("qwen3.jinja", "config", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}),
    "llama3": ("llama3.jinja", "config",
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    # Mistral-7B-Instruct-v0.1: roles must alternate (raise_exception), no generation prompt.
    "mistral": ("mistral.jinja", "config", ["<unk>", "<s>", "</s>"], [],
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    # SmolLM2-style: the template in chat_template.jinja (the newer HF layout).
    "smollm2": ("smollm2.jinja", "jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [],
                {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}),
}


FAILS = []


def check(cond, msg):
    """Records a failed check (and prints it); the test goes on, result() reports them all."""
    if not cond:
        FAILS.append(msg)
        print("FAIL:", msg)


def result():
    """The test's exit code: 1 when any check failed, else 0 (with "ok")."""
    if FAILS:
        print(f"{len(FAILS)} failure(s)")
        return 1
    print("ok")
    return 0


def template_text(name):
    with open(os.path.join(HERE, "templates", TEMPLATES[name][0]), encoding="utf-8") as f:
        return f.read()


def make_tokenizer_dir(name, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken

    _, where, special, added, cfg = TEMPLATES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    config.update({k: v for k, v in cfg.items()})
    text = template_text(name)
    if where == "config":
        config["chat_template"] = text
    else:
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out_dir


if __name__ == "__main__":
    import sys
    make_tokenizer_dir(sys.argv[1], sys.argv[2])
