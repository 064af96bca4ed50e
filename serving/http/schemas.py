"""Request and response bodies of the HTTP API, as pydantic models.

This is the one module the client (`tessera.clients`) imports from the server, so it depends on
pydantic only. It holds:

- the OpenAI dialect: `/v1/completions`, `/v1/chat/completions`, `/v1/models` and the error
  object `{"error": {"message", "type", "param", "code"}}`;
- the Megatron-LM dialect: the `PUT /api` body and answer;
- the KServe v2 generate extension's named inputs (`TritonInputs`), shared by `infer` (one row
  of tensors) and `generate` (one JSON object).

Request models are strict (`"16"` is not an integer, `true` is not a number) and reject nothing
they do not know about except where a field would change the answer silently (see each model).
Response models are lenient, so a newer server does not break an older client.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

# ----------------------------------------------------------------------------------- shared


class _Request(BaseModel):
    # Strict: a JSON string is never an int, a bool never a number. Unknown fields are ignored
    # (clients send e.g. `user`), except the ones listed per model that would change the answer.
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _check_prompt(value: Any) -> Any:
    """A prompt is a string, a token-id list, or a non-empty list of either."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    ok = isinstance(value, str) or (isinstance(value, list) and (
        is_ids(value) or all(isinstance(v, str) for v in value) or all(is_ids(v) for v in value)))
    if not ok:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, "
                         "or a list of token-id lists")
    if value == []:
        raise ValueError("prompt is an empty list")
    return value


def _as_stop_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _as_word_list(value: Any) -> Any:
    """TensorRT-LLM word lists: a string or a list of strings, empty strings dropped ("" and
    [""] mean none, as its clients send them)."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list):
        return [w for w in value if w != ""]
    return value


Prompt = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_prompt)]
# What clients may send (a string stands for a list of one), not the validated type.
_STRING_OR_LIST = {"anyOf": [{"type": "string"},
                              {"type": "array", "items": {"type": "string"}, "maxItems": 16}]}
StopStrings = Annotated[list[str] | None, BeforeValidator(_as_stop_list),
                        WithJsonSchema({"anyOf": [*_STRING_OR_LIST["anyOf"], {"type": "null"}]})]
WordList = Annotated[list[str], BeforeValidator(_as_word_list), WithJsonSchema(_STRING_OR_LIST)]


PRIORITY_DOC = "scheduling priority: lower runs first; equal priorities run in arrival order"
CACHE_SALT_DOC = ("prefix-cache isolation: KV blocks are shared only between requests with "
                  "the same salt (e.g. one per tenant)")
ADAPTER_DOC = "a LoRA adapter loaded on this server, by name (default: none)"


class SamplingFields(_Request):
    """The decoding settings both OpenAI routes share (OpenAI names plus the vLLM extras)."""

    model: str | None = Field(None, description="BASE, BASE:TASK, BASE:ADAPTER or a LoRA "
                                                "adapter's name; default: the base model")
    n: int = Field(1, ge=1, le=16, description="completions per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings = Field(None, description="a string or up to 16 strings; cut before them")
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: no top-k cut")
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    # Accepted for compatibility, refused when they would change the answer.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = Field(
        None, description="only {'type': 'text'}: constrained (JSON) decoding is not supported")
    # Scheduling and prefix-cache isolation (vLLM's names), passed to the engine as they are.
    priority: int = Field(0, ge=-2**31, lt=2**31, description=PRIORITY_DOC)
    cache_salt: str | None = Field(None, max_length=256, description=CACHE_SALT_DOC)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported by "
                             "this server: it does not constrain decoding to JSON (use 'text', "
                             "or ask for JSON in the prompt and validate the answer)")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        if self.stop is not None and len(self.stop) > 16:
            raise ValueError("stop takes at most 16 strings")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    """OpenAI's `response_format`; `json_schema` / `json_object` are refused (see above)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


# --------------------------------------------------------------------------- OpenAI: requests


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, description="tokens to generate at most")
    logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per position")
    echo: bool = Field(False, description="return the prompt before the completion")
    suffix: str | None = None

    @model_validator(mode="after")
    def _no_suffix(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported by this server")
        return self


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); other part types are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {p.type for p in self.content} - {"text"}
        if kinds:
            raise ValueError(f"message content of type {sorted(kinds)} is not supported (text only)")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=0, description="newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools (function calling) are not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -------------------------------------------------------------------------- OpenAI: responses


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    """A `/v1/completions` answer, and (with `usage` optional) each of its stream chunks."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None

    @property
    def text(self) -> str:
        """The first choice's text ("" for a usage-only stream chunk)."""
        return self.choices[0].text if self.choices else ""


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage = Field(default_factory=AssistantMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[ChatChoice] = Field(default_factory=list)
    usage: Usage | None = None

    @property
    def text(self) -> str:
        return (self.choices[0].message.content or "") if self.choices else ""


class ChatDelta(_Response):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta = Field(default_factory=ChatDelta)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChatChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None

    @property
    def text(self) -> str:
        return (self.choices[0].delta.content or "") if self.choices else ""


class ModelCard(_Response):
    """One `/v1/models` entry: the base model, `BASE:TASK` for a prompt-tuned task, or a LoRA
    adapter's name (with the base as `parent`)."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "tessera"
    root: str | None = None  # the base model
    parent: str | None = None  # the base model, for a task entry
    max_model_len: int | None = None

    @property
    def task(self) -> str | None:
        return self.id.partition(":")[2] or None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorDetail(_Response):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    """The OpenAI error body. (The Triton and /api dialects answer `{"error": "message"}`.)"""

    error: ErrorDetail


# ---------------------------------------------------------------------------- Megatron /api


class MegatronRequest(_Request):
    """`PUT /api`, as Megatron-LM's text generation server takes it.

    `tokens_to_generate: 0` with `logprobs: true` scores the prompts without generating.
    """

    prompts: list[str] = Field(min_length=1, max_length=128)
    tokens_to_generate: int = Field(64, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_k: int = Field(0, ge=0)
    top_p: float = Field(0.0, ge=0.0, le=1.0, description="0 means no nucleus cut")
    logprobs: bool = False
    random_seed: int | None = Field(None, ge=-1, lt=2**63, description="-1 or absent: random")
    add_BOS: bool = True  # noqa: N815 (Megatron's field name)
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    task: str | None = Field(None, description="a prompt-tuned task served by this model")
    # Per-request LoRA and scheduling
    adapter: str | None = Field(None, description=ADAPTER_DOC)
    priority: int = Field(0, ge=-2**31, lt=2**31, description=PRIORITY_DOC)
    cache_salt: str | None = Field(None, max_length=256, description=CACHE_SALT_DOC)

    @model_validator(mode="after")
    def _sampling_is_exclusive(self) -> MegatronRequest:
        if self.top_k > 0 and self.top_p > 0:
            raise ValueError("top_k and top_p cannot both be set")
        return self


class MegatronResponse(_Response):
    text: list[str]  # each prompt followed by its continuation
    segments: list[list[str]]  # the same, one string per token
    logprobs: list[list[float]] | None = None  # of every token after the first


# ------------------------------------------------------------------- KServe v2 / Triton


class TritonInputs(_Request):
    """The named inputs of the served model on `/v2/.../infer` (one batch row) and `generate`.

    The names follow NVIDIA's TensorRT-LLM `ensemble`, so its clients work unchanged. Unknown
    names are refused (a typo would otherwise change the answer silently).
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    text_input: str
    max_tokens: int = Field(64, ge=0)
    min_length: int = Field(0, ge=0, description="tokens to generate at least (ignores EOS)")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, ge=0.0, le=1.0, description="0 or 1: no nucleus cut")
    random_seed: int | None = Field(None, ge=0, lt=2**64)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop_words: WordList = Field(default_factory=list)
    return_log_probs: bool = False
    task: str | None = None
    task_id: int | str | None = None  # an index into the served tasks, or a task name
    stream: bool = False
    accumulate_tokens: bool = False  # generate_stream: each event carries the whole text so far
    # Sent by TensorRT-LLM clients; meaningless here but harmless.
    end_id: int | None = Field(None, description="an extra stop token id")
    pad_id: int | None = Field(None, description="accepted (and checked) for compatibility")
    beam_width: int = Field(1, ge=1, le=1, description="only 1 (no beam search)")
    exclude_input_in_output: bool = True
    # The rest of the TensorRT-LLM `ensemble` inputs, accepted where they change nothing here
    # (empty word lists, defaults) and refused otherwise.
    bad_words: WordList = Field(default_factory=list,
                                description="only empty: banning words is not supported")
    length_penalty: float = Field(1.0, description="beam search only: no effect at beam_width 1")
    num_return_sequences: int = Field(1, ge=1, le=1, description="only 1")
    return_context_logits: bool = Field(False, description="only false")
    return_generation_logits: bool = Field(False, description="only false")
    embedding_bias_words: WordList = Field(default_factory=list, description="only empty")
    embedding_bias_weights: list[float] = Field(default_factory=list, description="only empty")
    # Per-request LoRA (or name it in the URL: /v2/models/BASE:ADAPTER/...) and scheduling
    adapter: str | None = Field(None, description=ADAPTER_DOC)
    priority: int = Field(0, ge=-2**31, lt=2**31, description=PRIORITY_DOC)
    cache_salt: str | None = Field(None, max_length=256, description=CACHE_SALT_DOC)

    @model_validator(mode="after")
    def _one_task(self) -> TritonInputs:
        if self.task is not None and self.task_id is not None:
            raise ValueError("give task or task_id, not both")
        unsupported = [name for name in ("bad_words", "embedding_bias_words",
                                         "embedding_bias_weights", "return_context_logits",
                                         "return_generation_logits") if getattr(self, name)]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported by this server (leave it empty)")
        return self


class TritonGenerateResponse(_Response):
    model_name: str
    model_version: str = "1"
    text_output: str
    cum_log_probs: float | None = None
    output_log_probs: list[float] | None = None


# --------------------------------------------------------------- tokenizer (vLLM's shapes)


class TokenizeRequest(_Request):
    """`POST /tokenize`: a text `prompt`, or chat `messages` (as `/v1/chat/completions` runs them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="add BOS, as the completion routes do")
    add_generation_prompt: bool = Field(True, description="only true (as chat completions)")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if not self.add_generation_prompt:
            raise ValueError("add_generation_prompt: false is not supported")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfo(_Response):
    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None
    model_max_length: int | None = None
    vocab_size: int | None = None


SamplingFields.model_rebuild()
