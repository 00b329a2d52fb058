"""What the app refuses, and how it says so: every input of a run checked before any model work, a bad one
refused with what to change (:func:`refused`, a ``gr.Error`` toast), anything unforeseen reported in one line
(:func:`unexpected`, its traceback in the server log); and the models the checks load, once per process."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import math
import threading
import traceback
from dataclasses import dataclass, field

import gradio as gr
import pyarrow as pa
import torch

from .. import backend as backends
from .. import engine, settings
from ..models import load_model, load_tokenizer
from ..policies import REGISTRY, Policy, build_setting, get_spec, setting_label
from ..policies.base import BudgetTooSmall
from ..policies.checkpointed import CheckpointPolicy
from ..quote import excerpt, kind
from ..settings import APP_NAMES, Bounds, Settings
from .config import Limits

log = logging.getLogger(__name__)

try:  # glibc's malloc_trim hands freed heap pages back to the system; other C libraries keep them
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _malloc_trim = None

# The models loaded by this process, one per name (a load takes seconds to minutes), and a lock per name: one
# session loading a model must not hold up the sessions using another one already loaded.
_models: dict[str, tuple] = {}
_models_lock = threading.Lock()  # guards _loading only, for a moment
_loading: dict[str, threading.Lock] = {}
_tokenizers: dict[str, object] = {}  # tokenizers loaded without their model (opening a trace), one per name


def release_memory() -> None:
    """After a run, finished, failed or cancelled, or a refused file: drop its caches now, and hand arrow's
    pool, the C heap's free pages and a GPU's blocks back too."""
    gc.collect()
    pa.default_memory_pool().release_unused()
    if _malloc_trim is not None:
        _malloc_trim(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_model(limits: Limits, name: str):
    """The model ``name`` on the deployment's device and dtype, loaded once per process."""
    if name in _models:
        return _models[name]
    with _models_lock:
        loading = _loading.setdefault(name, threading.Lock())
    with loading:  # a second caller of the same name waits for the first one's load, not a load of its own
        if name not in _models:
            _models[name] = load_model(name, device=limits.device, dtype=limits.dtype or None)
        return _models[name]


def get_tokenizer(name: str):
    """A model's tokenizer alone: the loaded model's own, else loaded without weights, once.  Opening a trace
    needs no more, so it neither waits for nor takes a place in the models' run queue."""
    if name in _models:
        return _models[name][1]
    if name not in _tokenizers:  # two first callers may both load it: harmless, and no lock to wait on
        _tokenizers[name] = load_tokenizer(name)
    return _tokenizers[name]


# One widget per parameter name (first definition wins); _show_parameters relabels and re-ranges it for
# the selected policy, since e.g. SnapKV's and R-KV's `window` mean different things.
PARAMETERS: dict[str, dict] = {}
for _spec in REGISTRY.values():
    for _p in _spec.parameters():
        PARAMETERS.setdefault(_p["name"], _p)
PARAM_NAMES = sorted(PARAMETERS)


def policy_from_inputs(name: str, values: dict, strict: bool = False) -> Policy:
    """Build the policy from parameter values; the registry converts and range-checks each one.

    ``strict=False`` (the widgets): values of other policies' parameters are hidden widgets, ignored.
    ``strict=True`` (the API's JSON): a parameter this policy does not have is an error, not a no-op.
    """
    if not isinstance(values, dict):
        raise ValueError(f"the policy's parameters must be an object of names and values, got {kind(values)} "
                         f"({excerpt(values)})")
    spec = get_spec(name)
    if not strict:
        values = used_parameters(spec, values)
    return spec.build(**{key: value for key, value in values.items() if value is not None})


def used_parameters(spec, values: dict) -> dict:
    """The widgets' values of ``spec``'s own parameters that its chosen settings use: not other policies'
    (hidden widgets), nor those the chosen settings leave unused, which hold what they held."""
    own, unused = {p["name"] for p in spec.parameters()}, unused_parameters(spec, values) or {}
    return {key: value for key, value in values.items() if key in own and key not in unused}


def unused_parameters(spec, values: dict) -> dict[str, str] | None:
    """The parameters of ``spec`` that the widgets' choices and switches leave unused (which are unused
    depends on those alone, so only they are read); None while those do not build."""
    chosen = {p["name"]: values[p["name"]] for p in spec.parameters()
              if (p.get("choices") or isinstance(p["default"], bool)) and values.get(p["name"]) is not None}
    try:
        return spec.build(**chosen).unused()
    except ValueError:
        return None


def whole_number(label: str, value, low: int | None, high: int | None = None) -> int:
    """A count typed in a widget or sent to the API: None, NaN, infinity and fractions are refused; so is a
    number under ``low`` or over ``high`` (None: the caller's :mod:`kvviz.settings` check bounds it)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{label} is empty; type a whole number")
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"{label} must be a whole number, got {kind(value)} ({excerpt(value)})")
    if isinstance(value, int):  # exactly: a float would round 2**63 - 1 and overflow on 400 digits
        number = int(value)  # True is 1
    else:
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{label} must be a whole number, got {excerpt(value)}") from None
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{label} must be a whole number, got {excerpt(value)}")
        number = int(number)
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{label} must be between {low} and {high}, got {number}" if high is not None
                         else f"{label} must be at least {low}, got {number}")
    return number


def fraction(label: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):  # float(True) would be 1.0
        raise ValueError(f"{label} must be a number, got {kind(value)} ({excerpt(value)})")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # float(10**400) overflows
        raise ValueError(f"{label} must be a number, got {excerpt(value)}") from None


def flag(label: str, value) -> bool:
    """A switch sent to the API: true or false itself, never the text "false" (which is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be true or false, got {kind(value)} ({excerpt(value)})")
    return value


def served_model(limits: Limits, model_name) -> str:
    if not isinstance(model_name, str) or model_name not in limits.models:
        raise ValueError(f"model {excerpt(model_name)} is not available here; choose one of {', '.join(limits.models)}")
    return model_name


MAX_MESSAGE = 600  # characters of a refusal: a message that quotes a long input keeps its start and its advice


def refused(message: str) -> gr.Error:
    """What the user must change, in a toast that stays until closed: a timed one is easily missed while
    watching the plots, and the outputs then show a bare "Error"."""
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 200] + " [...] " + message[-190:]
    return gr.Error(message, duration=None, print_exception=False)


OUT_OF_MEMORY = (MemoryError, torch.cuda.OutOfMemoryError)
MAX_SEED = 2**53 - 1  # the largest whole number a double holds exactly


def unexpected(what: str, error: Exception) -> gr.Error:
    """A failure no validation foresaw: logged with its traceback on the server, one line for the user.

    The failed call's frames are then cleared: the error's traceback (the new one's context) would keep a
    failed run's cache alive through them while ``release_memory`` runs."""
    log.exception("%s failed", what)
    traceback.clear_frames(error.__traceback__)  # a frame still executing (the caller's) is left as it is
    if isinstance(error, OUT_OF_MEMORY):
        return refused(f"{what} ran out of memory; shorten the prompt, generate fewer tokens or choose a smaller "
                       "budget, then try again")
    return refused(f"{what} failed: {type(error).__name__}: {error}")


@contextlib.contextmanager
def refusing(what: str):
    """A check's body: a ValueError is the user's to fix (:func:`refused`), anything else :func:`unexpected`."""
    try:
        yield
    except ValueError as error:
        raise refused(str(error)) from None
    except Exception as error:
        raise unexpected(what, error) from None


@dataclass
class Request:
    model: object
    tokenizer: object
    prompt_ids: list[int]
    budget: int
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)  # engine.Sampler's arguments; empty: greedy
    compression: float | None = None  # the ρ that set budget; None: the budget was given in tokens
    prompt: str = ""  # as typed, before the chat template
    chat: bool = True

    def sampler(self) -> engine.Sampler:
        """A fresh sampler: every run (every policy of a comparison) draws the same random stream."""
        return engine.Sampler(**self.sampling)

    def events(self, policy: Policy, limits):
        """One run's step events, decoded by the deployment's backend (``limits.backend``,
        :func:`kvviz.backend.choose`: on a GPU the static slot path where it runs the policy, else the hook
        engine), which waits for the device in blocks at about the page's frame rate, not at every step."""
        return engine.stream(self.model, self.tokenizer, self.prompt_ids, policy, budget=self.budget,
                             max_new_tokens=self.max_new_tokens, backend=limits.backend,
                             reads_per_second=limits.figures_per_second or 1.0, **self.sampling)


MAX_TEMPERATURE = 2.0  # the app's: its slider's end (the library takes any)
# What the app allows beyond the library's rules; each deployment adds its own max new tokens (Limits.bounds).
# At most 2**53 - 1 for a seed: the page carries it as a double, which would round a larger one to another.
BOUNDS = Bounds(temperature=MAX_TEMPERATURE, seed=MAX_SEED)


def check_sampling(temperature: float, top_p: float, seed: float) -> dict:
    """engine.Sampler's arguments from the Sampling widgets (greedy at temperature 0); ValueError says what to
    change."""
    asked = Settings(temperature=fraction("temperature", temperature or 0.0),
                     top_p=fraction("top-p", 1.0 if top_p is None else top_p), names=APP_NAMES, bounds=BOUNDS)
    if asked.greedy:
        return {}
    # an emptied seed box is refused, as an emptied budget is, rather than run as some seed nobody typed
    return dataclasses.replace(asked, seed=whole_number("the seed", seed, None)).sampling


def check_prompt_text(prompt) -> None:
    """Refuse an empty prompt, or one that is not text a tokenizer takes, before anything loads."""
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt must be text, got {kind(prompt)} ({excerpt(prompt)})")
    if not prompt.strip():
        raise ValueError("the prompt is empty; type or paste some text")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate: half an emoji, cut when the text was
        raise ValueError(f"the prompt has a broken character at position {error.start} (half of a pair, e.g. of "
                         "an emoji cut in two); delete it or paste the text again") from None


def check_settings(limits: Limits, model_name: str, prompt: str, budget_mode: str, max_new_tokens: float) -> int:
    """What can be checked without the model; returns max new tokens.  Raises ValueError with what to change."""
    served_model(limits, model_name)
    check_prompt_text(prompt)
    if not isinstance(budget_mode, str) or budget_mode not in ("compression", "budget"):
        raise ValueError(f"size the cache by 'compression' or 'budget', got {excerpt(budget_mode)}")
    return settings.max_new_tokens(whole_number(APP_NAMES["max_new_tokens"], max_new_tokens, None),
                                   APP_NAMES["max_new_tokens"], limits.max_new_tokens)


def validate(limits: Limits, model_name: str, prompt: str, budget_mode: str, compression: float, budget: float,
             max_new_tokens: float, chat: bool, policies: list[Policy], temperature: float = 0.0, top_p: float = 1.0,
             seed: float = 0, backend: str = "engine") -> Request:
    """Check everything before any work; raise ValueError with what to change.  ``backend``: the decoder the
    run will use (:func:`kvviz.backend.choose`), which refuses a policy it cannot run."""
    max_new = check_settings(limits, model_name, prompt, budget_mode, max_new_tokens)
    chat = flag("chat", chat)
    sampling = check_sampling(temperature, top_p, seed)
    # the typed numbers too, before a model load that can take minutes
    if budget_mode == "budget":
        value = settings.budget(whole_number(APP_NAMES["budget"], budget, None), APP_NAMES["budget"])
    else:
        compression = settings.compression(fraction("compression", compression), APP_NAMES["compression"])
    model, tokenizer = get_model(limits, model_name)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=chat)
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the limit here is {limits.max_prompt_tokens}, "
                         "shorten it")
    engine.check_prompt(model, prompt_ids, max_new)
    if budget_mode == "budget":
        # A budget above the prompt is the long-generation regime (AvoKV-E's): eviction starts once the
        # generated tokens fill it.  Only a budget that the whole run never reaches is refused.
        fed = len(prompt_ids) + max_new - 1  # the last token is generated, never fed back
        if value >= fed:
            # More new tokens fill it once they feed back more than it holds: value - prompt + 2 of them,
            # offered only within this app's limit.
            needed = value - len(prompt_ids) + 2
            more = (f", or allow at least {needed} new tokens" if needed <= limits.max_new_tokens else
                    f" (even {limits.max_new_tokens} new tokens, the most allowed here, would not fill it)")
            raise ValueError(f"a budget of {value} holds the {len(prompt_ids)}-token prompt and all {max_new - 1} "
                             f"tokens fed back, so nothing would be evicted; choose a budget below {fed}{more}")
        resolved, compression = value, None  # the budget in tokens: no ρ set it
    else:
        resolved = engine.resolve_budget(len(prompt_ids), compression=compression)
    for policy in policies:
        try:
            backends.choose(model, policy, backend)  # "static" names what it cannot run
        except ValueError as error:
            raise ValueError(f"this app decodes on the static backend (KVVIZ_BACKEND=static), which cannot run "
                             f"{setting_label(policy)}: {str(error).split(': ', 1)[-1].split('; use')[0]}; "
                             "choose another policy") from None
        try:
            check_policy_fits(limits, model, tokenizer, prompt_ids, policy, resolved, compression, max_new)
        except ValueError as error:
            label = setting_label(policy)
            # among several compared, which one: "layers='99' names a layer beyond ..." named none
            if len(policies) > 1 and not str(error).startswith(label):
                raise ValueError(f"{label}: {error}") from None
            raise
    return Request(model, tokenizer, prompt_ids, resolved, max_new, sampling, compression, prompt, bool(chat))


def check_policy_fits(limits: Limits, model, tokenizer, prompt_ids: list[int], policy: Policy, budget: int,
                      compression: float | None, max_new: int) -> None:
    """Raise ValueError with what to change where ``policy`` cannot run on this model and prompt at this budget
    (set by ``compression``, or typed where that is None) for ``max_new`` tokens."""
    try:
        policy.reset(len(prompt_ids), budget, model.config.num_hidden_layers)
    except BudgetTooSmall as error:
        if compression is None:
            raise ValueError(budget_too_small(limits, error, len(prompt_ids), max_new)) from None
        # in compression mode no budget box is shown: name the compression that would do
        raise ValueError(engine.at_compression(error, compression, len(prompt_ids))) from None
    engine.check_policy(model, tokenizer, prompt_ids, policy)  # e.g. a RoPE Expected Attention cannot undo
    check_checkpoint_reached(limits, policy, len(prompt_ids), budget, max_new)


def budget_too_small(limits: Limits, error: BudgetTooSmall, prompt_len: int, max_new: int) -> str:
    """A typed budget within a policy's reserved entries: its message, unless no budget above them would
    evict anything in this run (one that holds every token fed is refused as well); then only what would do:
    lower what reserves them, or more new tokens (within this app's limit)."""
    fed = prompt_len + max_new - 1  # the last token is generated, never fed back
    if error.reserved + 1 < fed:
        return str(error)
    needed = error.reserved + 3 - prompt_len  # for a budget of reserved + 1 to sit below what they feed
    options = [f"lower {error.shrink}"] if error.shrink else []
    if needed <= limits.max_new_tokens:
        options.append(f"allow at least {needed} new tokens")
    return (f"budget {error.budget} must exceed {error.kept}, and a budget above {error.reserved} would hold all "
            f"{fed} tokens this run feeds, evicting none; " + (" or ".join(options) if options else
                                                                "give a longer prompt"))


def check_checkpoint_reached(limits: Limits, policy: Policy, prompt_len: int, budget: int, max_new: int) -> None:
    """Refuse a run in which a checkpointed policy (AvoKV-E, R-KV, LazyEviction) would decode no token from a
    cache it cut, saying what would: more new tokens, or a shorter interval.  A budget the run fills was
    advice enough for the others, and led such a policy to a run that cut nothing; a checkpoint at the last
    step cuts after the last forward pass, which nothing then reads."""
    if not isinstance(policy, CheckpointPolicy) or (first := policy.late_first_checkpoint(prompt_len, budget,
                                                                                          max_new)) is None:
        return
    last = max_new - 1  # the last decode step
    # Enough for the next checkpoint too, so that a whole interval decodes from the first cut; at least one step.
    wanted = [tokens for tokens in (first + policy.interval + 1, first + 2) if tokens <= limits.max_new_tokens]
    options = [f"allow at least {wanted[0]} new tokens"] if wanted else []
    if (widest := policy.widest_interval(prompt_len, budget, last - 1)) >= 1:
        options.append(f"set interval to {widest} or less")
    advice = " or ".join(options) or "choose a smaller budget and a shorter interval"
    when = f"after this run's last step ({last})" if first > last else "at this run's last step, after its last forward"
    raise ValueError(f"{setting_label(policy)} evicts only at its checkpoints, every {policy.interval} generated "
                     f"tokens once the cache is over B = {budget}: the first here would be at step {first}, {when}, "
                     f"so no token would be decoded from a cache it cut; {advice}")


def model_and_prompt(limits: Limits, model_name: str, prompt: str, chat: bool):
    """The loaded model, its tokenizer and the prompt's ids, for the on-demand analyses (probe, spectrum);
    raises ValueError with what to change."""
    served_model(limits, model_name)
    check_prompt_text(prompt)  # before a model load that can take minutes
    chat = flag("chat", chat)
    model, tokenizer = get_model(limits, model_name)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=chat)
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the limit here is {limits.max_prompt_tokens}, "
                         "shorten it")
    return model, tokenizer, prompt_ids


def policy_settings(entries, fewest: int, what: str) -> dict[str, str]:
    """The chosen policies, each a name or a setting such as ``inertia alpha=0.5``, by label, each distinct
    policy once (``inertia alpha=0.8`` is ``inertia``), ``fewest`` to four of them; ValueError with what to
    change otherwise (the API may send anything)."""
    if entries is None:
        entries = []
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, (list, tuple)) or not all(isinstance(entry, str) for entry in entries):
        raise ValueError(f"give the policies as a list of names or settings such as 'inertia alpha=0.5', got "
                         f"{excerpt(entries)}")
    settings, repeats = distinct_settings(entries)
    if len(settings) < fewest and repeats:
        entry, first, label = repeats[0]
        same = (f"'{entry}' is given twice" if entry.strip() == first.strip() else
                f"'{first}' and '{entry}' are one setting, which the registry names '{label}'")
        raise ValueError(f"{same}; change a value or add another policy to {what}")
    if not fewest <= len(settings) <= 4:
        raise ValueError(f"choose {'two' if fewest == 2 else 'one'} to four policies to {what} (one policy twice "
                         "needs two settings, e.g. 'inertia' and 'inertia alpha=0.5')")
    return settings


def distinct_settings(entries) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """Each distinct policy's first entry by label, and the entries that repeat one: (entry, the entry it
    repeats, their label)."""
    settings: dict[str, str] = {}
    repeats = []
    for entry in entries:
        label = build_setting(entry)[0]
        if label in settings:
            repeats.append((entry, settings[label], label))
        settings.setdefault(label, entry)
    return settings, repeats


def compare_settings(entries) -> dict[str, str]:
    return policy_settings(entries, 2, "compare")


def build_policies(settings: dict[str, str]) -> dict[str, Policy]:
    """A fresh policy for each label (a run leaves state in its policies)."""
    return {label: build_setting(entry)[1] for label, entry in settings.items()}
