"""Every flag of the pinned vLLM's serve parser, classified for the namespace (pure data).

vLLM's API server (``python -m vllm.entrypoints.openai.api_server``, the command the launcher
runs) parses its arguments with ``make_arg_parser(FlexibleArgumentParser())``. Each of its
flags, keyed by the parser's ``dest``, is in exactly one class:

``owned``
    kvpersist renders it from the configuration (``--model``, ``--max-model-len``,
    ``--kv-transfer-config``...), or the flag would override what it renders (``--config``,
    ``--uds``, vLLM's own KV offloading). Refused in ``KVP_VLLM_EXTRA_ARGS`` and in
    ``KVP_ENGINE_ARGS``.
``kv-affecting``
    For the same token ids, it can change the K/V values vLLM computes (weights, model
    configuration or code, precision, kernels and compilation, how the model is split across
    ranks) or what the connector stores (layout, dtype, which layers or states). Accepted
    only in the identity key ``KVP_ENGINE_ARGS``, whose canonical form enters the namespace.
``kv-neutral``
    Everything else: networking and the API, how requests become tokens (chunks are keyed by
    token ids: at worst a miss), what happens after the forward pass (sampling, outputs),
    scheduling, batching and memory sizing, logging and metrics. Allowed in
    ``KVP_VLLM_EXTRA_ARGS``.

In doubt a flag is kv-affecting: a flag wrongly called kv-affecting costs one cold cache, a
flag wrongly called neutral serves blocks another computation produced.

The table also records each flag's option strings and the shape of its value, so that
:mod:`kvpersist.config.engine_args` can read an argument list exactly as vLLM's parser does
without importing vLLM. ``tests/integration/test_engine_flags_vllm.py`` walks the pinned
vLLM's parser and fails when a flag is missing here, gone from vLLM, or described
differently; ``docs/engine-flags.md`` carries the table (``python -m
kvpersist.config.engine_flags`` prints it; a unit test keeps the two equal).

Value specs: ``help``, ``flag`` (store_true), ``bool`` (``--x``/``--no-x``), ``KIND`` (one
value), ``KIND+`` (one or more values), ``KIND?`` (an optional value, ``True`` without),
``append KIND`` (repeatable). KIND is how vLLM converts the text: ``str``, ``int``,
``float``, ``hrint`` (``1k``, ``2M``), ``hrint_auto`` (also ``auto``/``-1``), ``json``,
``dataclass`` (JSON, with ``1k``-style numbers), ``dict_or_str`` (JSON when it looks like
an object, else the text); ``|none`` means ``""`` and ``None`` give None.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the vLLM release whose parser this table describes
VLLM_VERSION = "0.32.0"

OWNED = "owned"
KV = "kv-affecting"
NEUTRAL = "kv-neutral"
CLASSES = (OWNED, KV, NEUTRAL)

KINDS = frozenset({"str", "int", "float", "hrint", "hrint_auto", "json", "dataclass",
                   "dict_or_str"})


@dataclass(frozen=True)
class Flag:
    """One ``dest`` of vLLM's parser: its option strings, value shape, class and reason."""

    dest: str
    #: every option string, as vLLM's parser has them (``--no-x`` included); () positional
    options: tuple[str, ...]
    #: value spec (see the module docstring)
    value: str
    cls: str
    reason: str

    @property
    def name(self) -> str:
        """The flag as documentation writes it: its first long option (or the dest)."""
        return next((o for o in self.options if o.startswith("--")), self.dest)

    @property
    def action(self) -> str:
        """``help``, ``flag``, ``bool``, ``append`` or ``store``."""
        if self.value in ("help", "flag", "bool"):
            return self.value
        return "append" if self.value.startswith("append ") else "store"

    @property
    def nargs(self) -> str | None:
        """argparse's nargs for a ``store``/``append`` flag: None, ``+`` or ``?``."""
        if self.action not in ("store", "append"):
            return None
        return self.value[-1] if self.value[-1] in "+?" else None

    @property
    def kind(self) -> str:
        """How vLLM converts one value (``str``, ``int``, ``json``...), without ``|none``."""
        spec = self.value.removeprefix("append ").rstrip("+?")
        return spec.removesuffix("|none")

    @property
    def optional(self) -> bool:
        """True when vLLM reads ``""`` and ``None`` as None."""
        return self.value.rstrip("+?").endswith("|none")


def _options(spec: str, value: str) -> tuple[str, ...]:
    """Option strings from the table's spelling; a ``bool`` flag gets ``--no-X`` after each
    ``--X`` as argparse's BooleanOptionalAction adds them."""
    out: list[str] = []
    for option in spec.split():
        out.append(option)
        if value == "bool" and option.startswith("--"):
            out.append("--no-" + option[2:])
    return tuple(out)


def _f(dest: str, options: str, value: str, cls: str, reason: str) -> Flag:
    return Flag(dest, _options(options, value), value, cls, reason)


# Reasons shared by many flags.
DP = 'data-parallel coordination of independent engines'
EP = 'expert parallelism: how MoE layers are decomposed across ranks (reduction order, kernels)'
HTTP = 'HTTP/API front end: how requests reach vLLM, not what it computes'
LOADIO = 'how the same weight files are read, not what they hold'
LOG = 'logging, metrics or tracing only'
LORA = ('LoRA: requests naming an adapter compute other K/V, and LMCache 0.5.6 keys chunks by '
        'token ids only')
MAMBA = 'Mamba/SSM state: the kernels or precision that compute the cached state'
MEM = 'memory sizing only: how many blocks fit, not their content'
MM_N = 'multimodal input plumbing or limits; the embeddings of an item do not change'
PLACE = 'where processes run and how they talk; the model is split the same way'
RENDER = ('changes which tokens a request becomes (a client can do the same); chunks are keyed by'
          ' token ids, so at worst a miss')
SAMPLE = ('acts after the forward pass (sampling, outputs); the KV of the prompt is already '
          'computed')
SCHED = ('scheduling and batching: every deployment already computes a prompt under varying '
         'batch shapes')


FLAGS: dict[str, Flag] = {f.dest: f for f in (
    _f('help', '-h --help', 'help', OWNED, 'prints help and exits: vLLM would not serve'),
    _f('model_tag', '', 'str?', OWNED,
       'the model: kvpersist renders --model <namespace> (a link to KVP_MODEL_PATH)'),
    _f('headless', '--headless', 'flag', NEUTRAL,
       'runs no API server (multi-node DP); KV unchanged, but the launch then never becomes '
       'healthy'),
    _f('api_server_count', '--api-server-count -asc', 'int', NEUTRAL,
       'number of API server processes'),
    _f('config', '--config', 'str', OWNED,
       "a YAML file of vLLM arguments could set any flag behind the check's back"),
    _f('grpc', '--grpc', 'flag', NEUTRAL,
       'serves gRPC instead of HTTP on the port; KV unchanged, but the launch then never '
       'becomes healthy'),
    _f('lora_modules', '--lora-modules', 'str|none+', KV, LORA + ' (adapters served)'),
    _f('chat_template', '--chat-template', 'str|none', OWNED,
       'identity field KVP_CHAT_TEMPLATE_SHA256 names the template'),
    _f('chat_template_content_format', '--chat-template-content-format', 'str', NEUTRAL, RENDER),
    _f('trust_request_chat_template', '--trust-request-chat-template', 'bool', NEUTRAL, RENDER),
    _f('trust_request_mm_kwargs', '--trust-request-mm-kwargs', 'bool', NEUTRAL,
       "per-request processor kwargs enter each multimodal item's hash (vLLM 0.32): at worst"
       ' a miss'),
    _f('default_chat_template_kwargs', '--default-chat-template-kwargs', 'json', NEUTRAL, RENDER),
    _f('response_role', '--response-role', 'str', NEUTRAL, HTTP),
    _f('return_tokens_as_token_ids', '--return-tokens-as-token-ids', 'bool', NEUTRAL, SAMPLE),
    _f('enable_auto_tool_choice', '--enable-auto-tool-choice', 'bool', NEUTRAL, RENDER),
    _f('exclude_tools_when_tool_choice_none',
       '--exclude-tools-when-tool-choice-none', 'bool', NEUTRAL, RENDER),
    _f('tool_call_parser', '--tool-call-parser', 'str|none', NEUTRAL, SAMPLE),
    _f('tool_parser_plugin', '--tool-parser-plugin', 'str', NEUTRAL, SAMPLE),
    _f('tool_strict_level', '--tool-strict-level', 'str', NEUTRAL, SAMPLE),
    _f('tool_server', '--tool-server', 'str|none', NEUTRAL, HTTP),
    _f('max_log_len', '--max-log-len', 'int|none', NEUTRAL, LOG),
    _f('enable_prompt_tokens_details', '--enable-prompt-tokens-details', 'bool', NEUTRAL, HTTP),
    _f('enable_per_request_metrics', '--enable-per-request-metrics', 'bool', NEUTRAL, LOG),
    _f('enable_server_load_tracking', '--enable-server-load-tracking', 'bool', NEUTRAL, LOG),
    _f('enable_force_include_usage', '--enable-force-include-usage', 'bool', NEUTRAL, HTTP),
    _f('sse_keep_alive_interval', '--sse-keep-alive-interval', 'int', NEUTRAL, HTTP),
    _f('enable_tokenizer_info_endpoint', '--enable-tokenizer-info-endpoint', 'bool', NEUTRAL,
       HTTP),
    _f('enable_log_outputs', '--enable-log-outputs', 'bool', NEUTRAL, LOG),
    _f('enable_log_deltas', '--enable-log-deltas', 'bool', NEUTRAL, LOG),
    _f('cohere_is_reasoning_model', '--cohere-is-reasoning-model', 'bool', NEUTRAL, SAMPLE),
    _f('cohere_format', '--cohere-format', 'str', NEUTRAL, RENDER),
    _f('anthropic_disabled_thinking_effort',
       '--anthropic-disabled-thinking-effort', 'str', NEUTRAL, RENDER),
    _f('log_error_stack', '--log-error-stack', 'bool', NEUTRAL, LOG),
    _f('tokens_only', '--tokens-only', 'bool', NEUTRAL, HTTP),
    _f('enable_scale_out', '--enable-scale-out', 'bool', NEUTRAL, HTTP),
    _f('fingerprint_mode', '--fingerprint-mode', 'str', NEUTRAL, HTTP),
    _f('fingerprint_value', '--fingerprint-value', 'str|none', NEUTRAL, HTTP),
    _f('host', '--host', 'str|none', OWNED, 'KVP_VLLM_HOST'),
    _f('port', '--port', 'int', OWNED, 'KVP_VLLM_PORT'),
    _f('grpc_port', '--grpc-port', 'int|none', NEUTRAL, HTTP),
    _f('data_parallel_supervisor_port', '--data-parallel-supervisor-port', 'int', NEUTRAL, DP),
    _f('dp_supervisor_probe_interval_s', '--dp-supervisor-probe-interval-s', 'float', NEUTRAL, DP),
    _f('dp_supervisor_probe_timeout_s', '--dp-supervisor-probe-timeout-s', 'float', NEUTRAL, DP),
    _f('dp_supervisor_probe_failure_threshold',
       '--dp-supervisor-probe-failure-threshold', 'int', NEUTRAL, DP),
    _f('uds', '--uds', 'str|none', OWNED,
       'a Unix socket replaces KVP_VLLM_HOST/KVP_VLLM_PORT, which clients and health checks use'),
    _f('uvicorn_log_level', '--uvicorn-log-level', 'str', NEUTRAL, LOG),
    _f('disable_uvicorn_access_log', '--disable-uvicorn-access-log', 'bool', NEUTRAL, LOG),
    _f('disable_access_log_for_endpoints',
       '--disable-access-log-for-endpoints', 'str|none', NEUTRAL, LOG),
    _f('allow_credentials', '--allow-credentials', 'bool', NEUTRAL, HTTP),
    _f('allowed_origins', '--allowed-origins', 'json', NEUTRAL, HTTP),
    _f('allowed_methods', '--allowed-methods', 'json', NEUTRAL, HTTP),
    _f('allowed_headers', '--allowed-headers', 'json', NEUTRAL, HTTP),
    _f('api_key', '--api-key', 'str|none+', NEUTRAL, HTTP),
    _f('ssl_keyfile', '--ssl-keyfile', 'str|none', NEUTRAL, HTTP),
    _f('ssl_certfile', '--ssl-certfile', 'str|none', NEUTRAL, HTTP),
    _f('ssl_ca_certs', '--ssl-ca-certs', 'str|none', NEUTRAL, HTTP),
    _f('enable_ssl_refresh', '--enable-ssl-refresh', 'bool', NEUTRAL, HTTP),
    _f('ssl_cert_reqs', '--ssl-cert-reqs', 'int', NEUTRAL, HTTP),
    _f('ssl_ciphers', '--ssl-ciphers', 'str|none', NEUTRAL, HTTP),
    _f('root_path', '--root-path', 'str|none', NEUTRAL, HTTP),
    _f('middleware', '--middleware', 'append str', NEUTRAL, HTTP),
    _f('enable_request_id_headers', '--enable-request-id-headers', 'bool', NEUTRAL, HTTP),
    _f('disable_fastapi_docs', '--disable-fastapi-docs', 'bool', NEUTRAL, HTTP),
    _f('h11_max_incomplete_event_size', '--h11-max-incomplete-event-size', 'int', NEUTRAL, HTTP),
    _f('h11_max_header_count', '--h11-max-header-count', 'int', NEUTRAL, HTTP),
    _f('enable_offline_docs', '--enable-offline-docs', 'bool', NEUTRAL, HTTP),
    _f('enable_flash_late_interaction', '--enable-flash-late-interaction', 'bool', NEUTRAL,
       'late-interaction scoring of pooling outputs, after the KV is computed'),
    _f('model', '--model', 'str', OWNED,
       'kvpersist renders --model <namespace> (a link to KVP_MODEL_PATH)'),
    _f('runner', '--runner', 'str', KV,
       'generate/pooling/draft runner: another model head and attention use'),
    _f('convert', '--convert', 'str', KV,
       'adapts the model (embed/classify/reward): another model'),
    _f('tokenizer', '--tokenizer', 'str', OWNED, 'identity field KVP_TOKENIZER_NAME'),
    _f('tokenizer_mode', '--tokenizer-mode', 'str', KV,
       'another tokenizer implementation for the same files; the identity pins the tokenizer'
       ' (KVP_TOKENIZER_NAME/REVISION), so this choice is pinned with it'),
    _f('trust_remote_code', '--trust-remote-code', 'bool', KV,
       'runs configuration (and tokenizer) code from the model repository, which takes '
       'precedence over the built-in classes where both exist'),
    _f('dtype', '--dtype', 'str', OWNED, 'rendered from KVP_KV_CACHE_DTYPE / KVP_MODEL_DTYPE'),
    _f('seed', '--seed', 'int', NEUTRAL,
       'seeds sampling; the forward pass of a prompt draws no random numbers (dummy weights '
       'use a fixed seed)'),
    _f('hf_config_path', '--hf-config-path', 'str|none', KV,
       'another config.json: architecture, rope, geometry'),
    _f('allowed_local_media_path', '--allowed-local-media-path', 'str', NEUTRAL, MM_N),
    _f('allowed_media_domains', '--allowed-media-domains', 'str|none+', NEUTRAL, MM_N),
    _f('revision', '--revision', 'str|none', OWNED, 'identity field KVP_MODEL_REVISION'),
    _f('code_revision', '--code-revision', 'str|none', KV,
       "another revision of the model repository's code"),
    _f('tokenizer_revision', '--tokenizer-revision', 'str|none', OWNED,
       'identity field KVP_TOKENIZER_REVISION'),
    _f('max_model_len', '--max-model-len', 'hrint_auto', OWNED,
       'identity field KVP_MAX_MODEL_LEN'),
    _f('quantization', '--quantization -q', 'str|none', KV,
       'quantized weights (and activations): other K/V values'),
    _f('quantization_config', '--quantization-config', 'dataclass|none', KV,
       'quantization scheme of weights and activations'),
    _f('allow_deprecated_quantization', '--allow-deprecated-quantization', 'bool', NEUTRAL,
       'permits a quantization method chosen elsewhere (checkpoint or --quantization); '
       'changes nothing itself'),
    _f('enforce_eager', '--enforce-eager', 'bool', KV,
       'no torch.compile: other kernels and fusions compute every layer, so other K/V bits'),
    _f('enable_return_routed_experts', '--enable-return-routed-experts', 'bool', NEUTRAL, SAMPLE),
    _f('return_sampling_mask', '--return-sampling-mask', 'bool', NEUTRAL, SAMPLE),
    _f('max_logprobs', '--max-logprobs', 'int', NEUTRAL, SAMPLE),
    _f('logprobs_mode', '--logprobs-mode', 'str', NEUTRAL, SAMPLE),
    _f('use_fp64_gumbel', '--use-fp64-gumbel', 'bool', NEUTRAL, SAMPLE),
    _f('enable_trace_replay', '--enable-trace-replay', 'bool', NEUTRAL, SAMPLE),
    _f('disable_sliding_window', '--disable-sliding-window', 'bool', KV,
       'full attention where the model uses a sliding window: other attention outputs'),
    _f('disable_cascade_attn', '--disable-cascade-attn', 'bool', NEUTRAL,
       'deprecated, has no effect in vLLM 0.32'),
    _f('skip_tokenizer_init', '--skip-tokenizer-init', 'bool', NEUTRAL,
       'clients send token ids; what is computed for them is unchanged'),
    _f('enable_prompt_embeds', '--enable-prompt-embeds', 'bool', KV,
       'requests may carry embeddings instead of token ids; the token-keyed cache cannot '
       'tell such prompts apart'),
    _f('served_model_name', '--served-model-name', 'str|none+', OWNED, 'KVP_SERVED_MODEL_NAME'),
    _f('config_format', '--config-format', 'str', KV,
       'reads another model configuration (hf or mistral format)'),
    _f('hf_token', '--hf-token', 'str?', NEUTRAL, 'credentials for downloads'),
    _f('hf_overrides', '--hf-overrides', 'dict_or_str', KV,
       'overrides the model configuration (rope scaling and theta, layers, heads...)'),
    _f('model_class_overrides', '--model-class-overrides', 'json', KV,
       'another model class computes the forward pass'),
    _f('pooler_config', '--pooler-config', 'dataclass|none', NEUTRAL,
       'pooling of hidden states after the forward pass'),
    _f('generation_config', '--generation-config', 'str', NEUTRAL, SAMPLE),
    _f('override_generation_config', '--override-generation-config', 'json', NEUTRAL, SAMPLE),
    _f('enable_sleep_mode', '--enable-sleep-mode', 'bool', NEUTRAL,
       'frees and restores memory; the same weights are restored'),
    _f('sleep_mode_offload_cudagraph', '--sleep-mode-offload-cudagraph', 'bool', NEUTRAL,
       'frees and restores memory; the same weights are restored'),
    _f('sleep_preserve_parameter_names', '--sleep-preserve-parameter-names', 'str+', NEUTRAL,
       'frees and restores memory; the same weights are restored'),
    _f('enable_cumem_allocator', '--enable-cumem-allocator', 'bool', NEUTRAL, 'memory allocator'),
    _f('enable_nccl_comm_suspend', '--enable-nccl-comm-suspend', 'bool', NEUTRAL,
       'frees and restores memory; the same weights are restored'),
    _f('model_impl', '--model-impl', 'str', KV,
       "another implementation of the model (vLLM's or Transformers')"),
    _f('logits_processors', '--logits-processors', 'str|none+', NEUTRAL, SAMPLE),
    _f('io_processor_plugin', '--io-processor-plugin', 'str|none', NEUTRAL,
       'turns requests into prompts and outputs into responses (pooling IO)'),
    _f('renderer_num_workers', '--renderer-num-workers', 'int', NEUTRAL,
       'threads that tokenise and render requests'),
    _f('load_format', '--load-format', 'str', KV,
       'how weights are read and converted (dummy random weights, bitsandbytes, gguf...)'),
    _f('download_dir', '--download-dir', 'str|none', NEUTRAL,
       'where downloads go; KVP_MODEL_PATH names the weights'),
    _f('safetensors_load_strategy', '--safetensors-load-strategy', 'str|none', NEUTRAL, LOADIO),
    _f('safetensors_prefetch_num_threads', '--safetensors-prefetch-num-threads', 'int', NEUTRAL,
       LOADIO),
    _f('safetensors_prefetch_block_size', '--safetensors-prefetch-block-size', 'hrint', NEUTRAL,
       LOADIO),
    _f('model_loader_extra_config', '--model-loader-extra-config', 'dict_or_str', KV,
       'options of the weight loader, which can change what is loaded'),
    _f('ignore_patterns', '--ignore-patterns', 'str+', KV, 'which checkpoint files are loaded'),
    _f('use_tqdm_on_load', '--use-tqdm-on-load', 'bool', NEUTRAL, LOG),
    _f('pt_load_map_location', '--pt-load-map-location', 'dict_or_str', NEUTRAL, LOADIO),
    _f('attention_backend', '--attention-backend', 'str|none', KV,
       'another attention kernel: other numerics, and some backends lay out the KV cache '
       'differently'),
    _f('mamba_backend', '--mamba-backend', 'str', KV, MAMBA),
    _f('mamba_ssu_algorithm', '--mamba-ssu-algorithm', 'str|none', KV, MAMBA),
    _f('enable_mamba_cache_stochastic_rounding',
       '--enable-mamba-cache-stochastic-rounding', 'bool', KV, MAMBA),
    _f('mamba_cache_philox_rounds', '--mamba-cache-philox-rounds', 'int', KV, MAMBA),
    _f('reasoning_parser', '--reasoning-parser', 'str', NEUTRAL, SAMPLE),
    _f('reasoning_parser_plugin', '--reasoning-parser-plugin', 'str', NEUTRAL, SAMPLE),
    _f('distributed_executor_backend', '--distributed-executor-backend', 'str|none', NEUTRAL,
       PLACE),
    _f('pipeline_parallel_size', '--pipeline-parallel-size -pp', 'int', KV,
       "layers split across ranks: each rank stores only its layers' KV"),
    _f('master_addr', '--master-addr', 'str', NEUTRAL, PLACE),
    _f('master_port', '--master-port', 'int', NEUTRAL, PLACE),
    _f('nnodes', '--nnodes -n', 'int', NEUTRAL, PLACE),
    _f('node_rank', '--node-rank -r', 'int', NEUTRAL, PLACE),
    _f('distributed_timeout_seconds', '--distributed-timeout-seconds', 'int|none', NEUTRAL, PLACE),
    _f('cpu_distributed_timeout_seconds', '--cpu-distributed-timeout-seconds', 'int|none', NEUTRAL,
       PLACE),
    _f('numa_bind', '--numa-bind', 'bool', NEUTRAL, PLACE),
    _f('numa_bind_nodes', '--numa-bind-nodes', 'int|none+', NEUTRAL, PLACE),
    _f('numa_bind_cpus', '--numa-bind-cpus', 'str|none+', NEUTRAL, PLACE),
    _f('device_ids', '--device-ids', 'str', NEUTRAL, PLACE),
    _f('tensor_parallel_size', '--tensor-parallel-size -tp', 'int', OWNED,
       'identity field KVP_TENSOR_PARALLEL_SIZE'),
    _f('decode_context_parallel_size', '--decode-context-parallel-size -dcp', 'int', KV,
       'shards the KV cache across ranks by token: another stored layout'),
    _f('dcp_comm_backend', '--dcp-comm-backend', 'str|none', KV,
       'how partial attention outputs of context-parallel ranks are combined'),
    _f('dcp_q_replicate', '--dcp-q-replicate', 'bool', KV,
       'another decode attention path under decode context parallelism'),
    _f('dcp_kv_cache_interleave_size', '--dcp-kv-cache-interleave-size', 'int', KV,
       'layout of the KV cache across context-parallel ranks'),
    _f('cp_kv_cache_interleave_size', '--cp-kv-cache-interleave-size', 'int', KV,
       'layout of the KV cache across context-parallel ranks'),
    _f('prefill_context_parallel_size', '--prefill-context-parallel-size -pcp', 'int', KV,
       'splits prefill across ranks: another decomposition of attention'),
    _f('data_parallel_size', '--data-parallel-size -dp', 'int', KV,
       'MoE layers are sharded over tensor x data parallel ranks: another decomposition'),
    _f('data_parallel_rank', '--data-parallel-rank -dpn', 'int', NEUTRAL, DP),
    _f('data_parallel_start_rank', '--data-parallel-start-rank -dpr', 'int', NEUTRAL, DP),
    _f('data_parallel_size_local', '--data-parallel-size-local -dpl', 'int', NEUTRAL, DP),
    _f('data_parallel_address', '--data-parallel-address -dpa', 'str', NEUTRAL, DP),
    _f('data_parallel_rpc_port', '--data-parallel-rpc-port -dpp', 'int', NEUTRAL, DP),
    _f('data_parallel_backend', '--data-parallel-backend -dpb', 'str', NEUTRAL, DP),
    _f('data_parallel_hybrid_lb', '--data-parallel-hybrid-lb -dph', 'bool', NEUTRAL, DP),
    _f('data_parallel_external_lb', '--data-parallel-external-lb -dpe', 'bool', NEUTRAL, DP),
    _f('data_parallel_multi_port_external_lb',
       '--data-parallel-multi-port-external-lb -dpm', 'flag', NEUTRAL, DP),
    _f('enable_hc_sp', '--enable-hc-sp', 'bool', KV,
       'sequence parallelism inside the model: another decomposition'),
    _f('enable_expert_parallel', '--enable-expert-parallel -ep', 'bool', KV, EP),
    _f('enable_batch_sharded_sampling', '--enable-batch-sharded-sampling', 'bool', NEUTRAL,
       SAMPLE),
    _f('enable_ep_weight_filter', '--enable-ep-weight-filter', 'bool', NEUTRAL,
       "reads only the local experts' weights; the same values"),
    _f('all2all_backend', '--all2all-backend', 'str', KV, EP),
    _f('enable_dbo', '--enable-dbo', 'bool', NEUTRAL,
       'splits a batch into micro-batches: scheduling and batching: every deployment already'
       ' computes a prompt under varying batch shapes'),
    _f('enable_shm_tensor_arena', '--enable-shm-tensor-arena', 'bool', NEUTRAL,
       'how inputs reach the workers'),
    _f('ubatch_size', '--ubatch-size', 'int', NEUTRAL,
       'splits a batch into micro-batches: scheduling and batching: every deployment already'
       ' computes a prompt under varying batch shapes'),
    _f('enable_elastic_ep', '--enable-elastic-ep', 'bool', KV,
       EP + '; the data-parallel size may change while serving'),
    _f('elastic_ep_max_dp_size', '--elastic-ep-max-dp-size', 'int', KV,
       EP + '; the data-parallel size may change while serving'),
    _f('dbo_decode_token_threshold', '--dbo-decode-token-threshold', 'int', NEUTRAL,
       'splits a batch into micro-batches: scheduling and batching: every deployment already'
       ' computes a prompt under varying batch shapes'),
    _f('dp_sync_interval', '--dp-sync-interval', 'int', NEUTRAL, DP),
    _f('dbo_prefill_token_threshold', '--dbo-prefill-token-threshold', 'int', NEUTRAL,
       'splits a batch into micro-batches: scheduling and batching: every deployment already'
       ' computes a prompt under varying batch shapes'),
    _f('disable_nccl_for_dp_synchronization',
       '--disable-nccl-for-dp-synchronization', 'bool', NEUTRAL, DP),
    _f('enable_eplb', '--enable-eplb', 'bool', KV,
       EP + '; experts move between ranks while serving'),
    _f('eplb_config', '--eplb-config', 'dataclass', KV,
       EP + '; experts move between ranks while serving'),
    _f('expert_placement_strategy', '--expert-placement-strategy', 'str', KV, EP),
    _f('max_parallel_loading_workers', '--max-parallel-loading-workers', 'int|none', NEUTRAL,
       LOADIO),
    _f('ray_workers_use_nsight', '--ray-workers-use-nsight', 'bool', NEUTRAL, LOG),
    _f('disable_custom_all_reduce', '--disable-custom-all-reduce', 'bool', KV,
       'another all-reduce kernel under tensor parallelism: another summation order'),
    _f('worker_cls', '--worker-cls', 'str', KV, 'replaces the worker that runs the model'),
    _f('worker_extension_cls', '--worker-extension-cls', 'str', KV,
       'code injected into the workers, reachable over RPC (e.g. weight updates)'),
    _f('enable_fault_tolerance', '--enable-fault-tolerance', 'bool', NEUTRAL, PLACE),
    _f('fault_tolerance_config', '--fault-tolerance-config', 'dataclass', NEUTRAL, PLACE),
    _f('block_size', '--block-size', 'int', OWNED, 'identity field KVP_BLOCK_SIZE'),
    _f('gpu_memory_utilization',
       '--gpu-memory-utilization --device-memory-utilization', 'float', NEUTRAL, MEM),
    _f('kv_cache_memory_bytes', '--kv-cache-memory-bytes', 'hrint|none', NEUTRAL, MEM),
    _f('kv_cache_dtype', '--kv-cache-dtype', 'str', OWNED, 'identity field KVP_KV_CACHE_DTYPE'),
    _f('num_gpu_blocks_override', '--num-gpu-blocks-override', 'int|none', NEUTRAL, MEM),
    _f('enable_prefix_caching', '--enable-prefix-caching', 'bool', NEUTRAL,
       "vLLM's in-memory prefix cache; the bytes of a block are the same"),
    _f('prefix_caching_hash_algo', '--prefix-caching-hash-algo', 'str', NEUTRAL,
       "hash of vLLM's in-memory prefix cache: at worst a miss"),
    _f('prefix_cache_retention_interval', '--prefix-cache-retention-interval', 'int|none', NEUTRAL,
       "which checkpoints vLLM's in-memory prefix cache keeps"),
    _f('kv_cache_dtype_skip_layers', '--kv-cache-dtype-skip-layers', 'str+', KV,
       'which layers keep an unquantized KV cache: another stored dtype per layer'),
    _f('kv_sharing_fast_prefill', '--kv-sharing-fast-prefill', 'bool', KV,
       'some layers skip prefill tokens (KV sharing): another computation'),
    _f('swa_bounded_replay', '--swa-bounded-replay', 'bool', KV,
       'keeps sliding-window KV out of the cache and recomputes it: another stored content'),
    _f('mamba_cache_dtype', '--mamba-cache-dtype', 'str', KV, 'dtype of the cached Mamba state'),
    _f('mamba_ssm_cache_dtype', '--mamba-ssm-cache-dtype', 'str', KV,
       'dtype of the cached SSM state'),
    _f('mamba_block_size', '--mamba-block-size', 'int|none', KV,
       'block layout of the cached Mamba state'),
    _f('prefix_match_unit', '--prefix-match-unit', 'int|none', NEUTRAL,
       "granularity of vLLM's in-memory prefix matching"),
    _f('mamba_cache_mode', '--mamba-cache-mode', 'str', KV,
       'which Mamba states are cached, at which positions'),
    _f('enable_mamba_shared_prefix_checkpoint',
       '--enable-mamba-shared-prefix-checkpoint', 'bool', KV,
       'which Mamba states are cached, at which positions'),
    _f('replayssm_buffer_len', '--replayssm-buffer-len', 'int', KV, MAMBA),
    _f('use_replayssm', '--use-replayssm', 'bool', KV, MAMBA),
    _f('kv_offloading_size', '--kv-offloading-size', 'float|none', OWNED,
       "turns on vLLM's own offloading, which replaces the connector of the rendered --kv-"
       'transfer-config'),
    _f('kv_offloading_backend', '--kv-offloading-backend', 'str', OWNED,
       "the connector vLLM's own offloading puts in place of the rendered --kv-transfer-config"),
    _f('offload_backend', '--offload-backend', 'str', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('cpu_offload_gb', '--cpu-offload-gb', 'float', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('cpu_offload_params', '--cpu-offload-params', 'str+', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('offload_group_size', '--offload-group-size', 'int', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('offload_num_in_group', '--offload-num-in-group', 'int', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('offload_prefetch_step', '--offload-prefetch-step', 'int', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('offload_params', '--offload-params', 'str+', NEUTRAL,
       'keeps the same weights in CPU memory'),
    _f('language_model_only', '--language-model-only', 'bool', NEUTRAL, MM_N),
    _f('limit_mm_per_prompt', '--limit-mm-per-prompt', 'json', NEUTRAL, MM_N),
    _f('enable_mm_embeds', '--enable-mm-embeds', 'bool', KV,
       'requests may carry precomputed multimodal embeddings; kvpersist cannot vouch they '
       'are what the encoder computes'),
    _f('media_io_kwargs', '--media-io-kwargs', 'json', KV,
       'how media are decoded (e.g. video frames): other embeddings for the same input'),
    _f('mm_processor_kwargs', '--mm-processor-kwargs', 'json|none', NEUTRAL,
       "processor kwargs enter each multimodal item's hash (vLLM 0.32): at worst a miss"),
    _f('mm_processor_cache_gb', '--mm-processor-cache-gb', 'float', NEUTRAL, MM_N),
    _f('mm_processor_cache_type', '--mm-processor-cache-type', 'str', NEUTRAL, MM_N),
    _f('mm_hasher_algorithm', '--mm-hasher-algorithm', 'str', NEUTRAL,
       'hash of multimodal items: other keys, at worst a miss'),
    _f('mm_shm_cache_max_object_size_mb', '--mm-shm-cache-max-object-size-mb', 'int', NEUTRAL,
       MM_N),
    _f('mm_encoder_only', '--mm-encoder-only', 'bool', NEUTRAL,
       'runs only the encoder: this process computes no KV'),
    _f('mm_encoder_tp_mode', '--mm-encoder-tp-mode', 'str', KV,
       'another decomposition of the multimodal encoder: other embeddings'),
    _f('mm_encoder_attn_backend', '--mm-encoder-attn-backend', 'str|none', KV,
       'another attention kernel in the multimodal encoder: other embeddings'),
    _f('mm_encoder_attn_dtype', '--mm-encoder-attn-dtype', 'str|none', KV,
       'fp8 attention in the multimodal encoder: other embeddings'),
    _f('mm_encoder_fp8_scale_path', '--mm-encoder-fp8-scale-path', 'str|none', KV,
       'fp8 scales of the multimodal encoder: other embeddings'),
    _f('mm_encoder_fp8_scale_save_path', '--mm-encoder-fp8-scale-save-path', 'str|none', NEUTRAL,
       'only saves calibrated scales to a file'),
    _f('mm_encoder_fp8_scale_save_margin', '--mm-encoder-fp8-scale-save-margin', 'float', NEUTRAL,
       'only scales what is saved to a file'),
    _f('interleave_mm_strings', '--interleave-mm-strings', 'bool', NEUTRAL, RENDER),
    _f('skip_mm_profiling', '--skip-mm-profiling', 'bool', NEUTRAL, MEM),
    _f('video_pruning_rate', '--video-pruning-rate', 'float|none', KV,
       'drops video tokens: other inputs to the model for the same video'),
    _f('video_pruning_method', '--video-pruning-method', 'str', KV,
       'drops video tokens: other inputs to the model for the same video'),
    _f('mm_tensor_ipc', '--mm-tensor-ipc', 'str', NEUTRAL, MM_N),
    _f('mm_processor_device', '--mm-processor-device', 'str', KV,
       'preprocessing on another device: other numerics of the embeddings'),
    _f('mm_ipc_gpu_memory_gb', '--mm-ipc-gpu-memory-gb', 'float', NEUTRAL, MEM),
    _f('mm_device_do_normalize', '--mm-device-do-normalize', 'bool', KV,
       'normalisation moved to the device: other numerics of the embeddings'),
    _f('enable_lora', '--enable-lora', 'bool', KV, LORA),
    _f('max_loras', '--max-loras', 'int', KV, LORA),
    _f('max_lora_rank', '--max-lora-rank', 'int', KV, LORA),
    _f('lora_dtype', '--lora-dtype', 'str', KV, LORA),
    _f('enable_tower_connector_lora', '--enable-tower-connector-lora', 'bool', KV, LORA),
    _f('max_cpu_loras', '--max-cpu-loras', 'int|none', KV, LORA),
    _f('fully_sharded_loras', '--fully-sharded-loras', 'bool', KV, LORA),
    _f('lora_target_modules', '--lora-target-modules', 'str|none+', KV, LORA),
    _f('default_mm_loras', '--default-mm-loras', 'json|none', KV, LORA),
    _f('specialize_active_lora', '--specialize-active-lora', 'bool', KV, LORA),
    _f('enable_mixed_moe_lora_format', '--enable-mixed-moe-lora-format', 'bool', KV, LORA),
    _f('enable_moe_shared_loras', '--enable-moe-shared-loras', 'bool', KV, LORA),
    _f('max_lora_cls_labels', '--max-lora-cls-labels', 'int|none', KV, LORA),
    _f('logging_config', '--logging-config', 'dataclass', NEUTRAL, LOG),
    _f('log_level', '--log-level', 'str', NEUTRAL, LOG),
    _f('log_config_file', '--log-config-file', 'str', NEUTRAL, LOG),
    _f('show_hidden_metrics_for_version', '--show-hidden-metrics-for-version', 'str|none', NEUTRAL,
       LOG),
    _f('otlp_traces_endpoint', '--otlp-traces-endpoint', 'str|none', NEUTRAL, LOG),
    _f('collect_detailed_traces', '--collect-detailed-traces', 'str|none+', NEUTRAL, LOG),
    _f('per_request_spec_decode_metrics', '--per-request-spec-decode-metrics', 'str', NEUTRAL,
       LOG),
    _f('kv_cache_metrics', '--kv-cache-metrics', 'bool', NEUTRAL, LOG),
    _f('kv_cache_metrics_sample', '--kv-cache-metrics-sample', 'float', NEUTRAL, LOG),
    _f('custom_histogram_buckets', '--custom-histogram-buckets', 'json|none', NEUTRAL, LOG),
    _f('cudagraph_metrics', '--cudagraph-metrics', 'bool', NEUTRAL, LOG),
    _f('enable_layerwise_nvtx_tracing', '--enable-layerwise-nvtx-tracing', 'bool', NEUTRAL, LOG),
    _f('enable_mfu_metrics', '--enable-mfu-metrics', 'bool', NEUTRAL, LOG),
    _f('enable_logging_iteration_details', '--enable-logging-iteration-details', 'bool', NEUTRAL,
       LOG),
    _f('jit_monitor_mode', '--jit-monitor-mode', 'str', NEUTRAL, LOG),
    _f('jit_monitor_verbose', '--jit-monitor-verbose', 'bool', NEUTRAL, LOG),
    _f('max_num_batched_tokens', '--max-num-batched-tokens', 'hrint', NEUTRAL, SCHED),
    _f('max_num_scheduled_tokens', '--max-num-scheduled-tokens', 'hrint|none', NEUTRAL, SCHED),
    _f('max_num_seqs', '--max-num-seqs', 'int', NEUTRAL, SCHED),
    _f('max_num_active_seqs', '--max-num-active-seqs', 'int|none', NEUTRAL, SCHED),
    _f('max_num_queued_reqs', '--max-num-queued-reqs', 'int|none', NEUTRAL, SCHED),
    _f('max_num_queued_tokens', '--max-num-queued-tokens', 'hrint|none', NEUTRAL, SCHED),
    _f('long_prefill_token_threshold', '--long-prefill-token-threshold', 'int', NEUTRAL, SCHED),
    _f('long_prefill_token_threshold_adaptive',
       '--long-prefill-token-threshold-adaptive', 'bool', NEUTRAL, SCHED),
    _f('scheduling_policy', '--scheduling-policy', 'str', NEUTRAL, SCHED),
    _f('enable_chunked_prefill', '--enable-chunked-prefill', 'bool', NEUTRAL, SCHED),
    _f('disable_chunked_mm_input', '--disable-chunked-mm-input', 'bool', NEUTRAL, SCHED),
    _f('scheduler_cls', '--scheduler-cls', 'str|none', NEUTRAL, SCHED),
    _f('scheduler_reserve_full_isl', '--scheduler-reserve-full-isl', 'bool', NEUTRAL, SCHED),
    _f('watermark', '--watermark', 'float', NEUTRAL, SCHED),
    _f('prefill_schedule_interval', '--prefill-schedule-interval', 'int', NEUTRAL, SCHED),
    _f('disable_hybrid_kv_cache_manager', '--disable-hybrid-kv-cache-manager', 'bool', KV,
       'one KV cache group for all attention types: another stored layout'),
    _f('async_scheduling', '--async-scheduling', 'bool', NEUTRAL, SCHED),
    _f('stream_interval', '--stream-interval', 'int', NEUTRAL, HTTP),
    _f('cudagraph_capture_sizes', '--cudagraph-capture-sizes', 'int+', NEUTRAL,
       'batch sizes replayed from CUDA graphs: scheduling and batching: every deployment '
       'already computes a prompt under varying batch shapes'),
    _f('max_cudagraph_capture_size', '--max-cudagraph-capture-size', 'int', NEUTRAL,
       'batch sizes replayed from CUDA graphs: scheduling and batching: every deployment '
       'already computes a prompt under varying batch shapes'),
    _f('ir_op_priority', '--ir-op-priority', 'dataclass', KV,
       'which kernel implements each operation'),
    _f('enable_flashinfer_autotune', '--enable-flashinfer-autotune', 'bool', KV,
       'kernel tactics chosen by timing at start-up'),
    _f('moe_backend', '--moe-backend', 'str', KV, 'another MoE kernel'),
    _f('linear_backend', '--linear-backend', 'str', KV, 'another GEMM kernel for linear layers'),
    _f('sparse_indexer_topk_backend', '--sparse-indexer-topk-backend', 'str', KV,
       'another top-k kernel of sparse attention (which tokens attend)'),
    _f('speculative_config', '--speculative-config -sc', 'json|none', KV,
       "the draft model's layers join the KV cache the connector stores"),
    _f('spec_method', '--spec-method', 'str|none', KV,
       "the draft model's layers join the KV cache the connector stores"),
    _f('spec_model', '--spec-model', 'str|none', KV,
       "the draft model's layers join the KV cache the connector stores"),
    _f('spec_tokens', '--spec-tokens', 'int', KV,
       "the draft model's layers join the KV cache the connector stores"),
    _f('watermark_config', '--watermark-config', 'json|none', NEUTRAL, SAMPLE),
    _f('diffusion_config', '--diffusion-config -dc', 'json|none', KV,
       'diffusion decoding: another use of attention and of the cache'),
    _f('kv_transfer_config', '--kv-transfer-config', 'dataclass|none', OWNED,
       'rendered: the LMCache connector and its server'),
    _f('kv_events_config', '--kv-events-config', 'dataclass|none', NEUTRAL, LOG),
    _f('ec_transfer_config', '--ec-transfer-config', 'dataclass|none', KV,
       'encoder outputs computed by another instance'),
    _f('ec_manager_config', '--ec-manager-config', 'dataclass', NEUTRAL,
       'where encoder outputs are cached, not their values'),
    _f('compilation_config', '--compilation-config -cc', 'dataclass', KV,
       'torch.compile mode, fusion passes and custom ops: other kernels for every layer'),
    _f('attention_config', '--attention-config -ac', 'dataclass', KV,
       'attention backend and options: other numerics or KV layout'),
    _f('engram_config', '--engram-config', 'dataclass|none', KV,
       'n-gram embedding storage and sharding inside the model'),
    _f('reasoning_config', '--reasoning-config', 'dataclass|none', NEUTRAL, SAMPLE),
    _f('kernel_config', '--kernel-config', 'dataclass', KV,
       'which kernels implement each operation'),
    _f('additional_config', '--additional-config', 'dict_or_str', KV,
       'platform-specific options that may change anything'),
    _f('structured_outputs_config', '--structured-outputs-config', 'dataclass', NEUTRAL, SAMPLE),
    _f('aux_output_config', '--aux-output-config', 'dataclass', NEUTRAL, SAMPLE),
    _f('profiler_config', '--profiler-config', 'dataclass', NEUTRAL, LOG),
    _f('optimization_level', '--optimization-level', 'str', KV,
       'selects the compilation mode and fusion passes: other kernels'),
    _f('performance_mode', '--performance-mode', 'str', NEUTRAL,
       'in vLLM 0.32 only sizes CUDA graphs and the batch budget: scheduling and batching: '
       'every deployment already computes a prompt under varying batch shapes'),
    _f('weight_transfer_config', '--weight-transfer-config', 'dataclass|none', KV,
       'lets a trainer replace the weights while serving'),
    _f('disable_log_stats', '--disable-log-stats', 'flag', NEUTRAL, LOG),
    _f('aggregate_engine_logging', '--aggregate-engine-logging', 'flag', NEUTRAL, LOG),
    _f('fail_on_environ_validation', '--fail-on-environ-validation', 'bool', NEUTRAL,
       'start-up validation of VLLM_* environment variables'),
    _f('shutdown_timeout', '--shutdown-timeout', 'int', NEUTRAL, 'grace period at shutdown'),
    _f('gdn_prefill_backend', '--gdn-prefill-backend', 'str', KV,
       'another kernel for gated delta-net layers'),
    _f('kda_prefill_backend', '--kda-prefill-backend', 'str', KV,
       'another kernel for Kimi delta attention layers'),
    _f('kda_decode_backend', '--kda-decode-backend', 'str', KV,
       'another kernel for Kimi delta attention layers'),
    _f('enable_log_requests', '--enable-log-requests', 'bool', NEUTRAL, LOG),
)}


def by_class(cls: str) -> list[Flag]:
    """The flags of one class, by name."""
    return sorted((f for f in FLAGS.values() if f.cls == cls), key=lambda f: f.name)


_TITLES = {
    OWNED: "Owned by kvpersist (refused in both keys)",
    KV: "KV-affecting (only in `KVP_ENGINE_ARGS`: they enter the namespace)",
    NEUTRAL: "KV-neutral (allowed in `KVP_VLLM_EXTRA_ARGS`)",
}


def markdown() -> str:
    """The flag table as the Markdown block of ``docs/engine-flags.md``."""
    counts = ", ".join(f"{len(by_class(c))} {c}" for c in CLASSES)
    lines = [f"vLLM {VLLM_VERSION}: {len(FLAGS)} flags ({counts}).", ""]
    for cls in CLASSES:
        lines += [f"### {_TITLES[cls]}", "", "| flag | dest | why |", "|---|---|---|"]
        for f in by_class(cls):
            spelled = " ".join(f"`{o}`" for o in f.options) or "(positional)"
            lines.append(f"| {spelled} | `{f.dest}` | {f.reason} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
