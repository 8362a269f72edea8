"""Layering: which process each module of gateway/ runs in, and a check that no module
imports one the table places in another process (the front end never imports torch; the
worker never imports the HTTP layer). A new module must be placed in the table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway

ROOT = Path(gateway.__file__).parent
FRONT_END, ENGINE_CORE, WORKER, SHARED = "front-end", "engine-core", "worker", "shared"

PROCESS_OF = {module: process for process, modules in {
    # Imported by more than one process: torch only lazily, inside functions.
    SHARED: """gateway gateway.config gateway.envs gateway.logger gateway.messages
        gateway.sampling_params gateway.pooling_params gateway.tokenizer gateway.gguf_tokenizer
        gateway.engine
        gateway.models gateway.models.registry gateway.models.paths gateway.models.gguf_file
        gateway.models.hf_resolve
        gateway.plugins gateway.plugins.contracts gateway.plugins.discovery
        gateway.plugins.groups gateway.plugins.loader gateway.plugins.process
        gateway.plugins.records gateway.platforms gateway.platforms.interface
        gateway.platforms.cpu gateway.platforms.cuda gateway.platforms.cpu_isa gateway.worker gateway.chat_escape
        gateway.structured_outputs_params gateway.gc_stats gateway.models.decoder_config
        gateway.models.support gateway.ray_cluster""",
    # The API server (and the offline LLM's process): HTTP, tokenizer, stat loggers.
    FRONT_END: """gateway.engine.client gateway.engine.output_processor
        gateway.engine.parallel_sampling gateway.engine.detokenizer gateway.entrypoints
        gateway.entrypoints.api_server gateway.engine.dp_client gateway.engine.dp_balance
        gateway.entrypoints.args gateway.entrypoints.auth gateway.entrypoints.cli
        gateway.entrypoints.cli.generate gateway.entrypoints.cli.main
        gateway.entrypoints.cli.plugins gateway.entrypoints.cli.serve
        gateway.entrypoints.endpoint_plugins gateway.entrypoints.errors
        gateway.entrypoints.io_processor gateway.entrypoints.llm gateway.entrypoints.middleware
        gateway.entrypoints.openai gateway.entrypoints.openai.chat
        gateway.entrypoints.openai.completions gateway.entrypoints.openai.embeddings
        gateway.entrypoints.openai.generation gateway.entrypoints.openai.pooling
        gateway.entrypoints.openai.classify gateway.entrypoints.openai.serving_score
        gateway.entrypoints.openai.score_protocol
        gateway.entrypoints.openai.protocol gateway.entrypoints.openai.sampling
        gateway.entrypoints.openai.tokenize gateway.entrypoints.responses
        gateway.entrypoints.server_routes gateway.metrics gateway.metrics.attach
        gateway.metrics.loggers gateway.metrics.manager gateway.metrics.plugin_metrics
        gateway.metrics.prometheus gateway.metrics.registry gateway.metrics.http_metrics
        gateway.metrics.process_metrics gateway.engine.request_logger gateway.entrypoints.startup
        gateway.entrypoints.tracing gateway.entrypoints.route_owners gateway.entrypoints.arg_types
        gateway.entrypoints.openai.chat_template
        gateway.entrypoints.openai.cli_args gateway.entrypoints.openai.fanout
        gateway.entrypoints.openai.ignored_fields gateway.entrypoints.openai.logprobs
        gateway.entrypoints.openai.serving gateway.entrypoints.connections
        gateway.entrypoints.log_redaction gateway.entrypoints.prompt_work
        gateway.entrypoints.unicode_guard gateway.entrypoints.openai.chat_output
        gateway.entrypoints.openai.chat_parsers gateway.entrypoints.openai.chat_tools
        gateway.entrypoints.openai.reasoning_parsers gateway.entrypoints.openai.structured_outputs
        gateway.entrypoints.openai.tool_parsers gateway.entrypoints.openai.tool_parsers.base
        gateway.entrypoints.openai.tool_parsers.hermes
        gateway.entrypoints.openai.tool_parsers.json_parser
        gateway.entrypoints.openai.tool_parsers.registry
        gateway.engine.admission gateway.engine.liveness gateway.entrypoints.drain
        gateway.entrypoints.loop_watchdog gateway.entrypoints.reliability
        gateway.entrypoints.route_timeout
        gateway.engine.connected_client gateway.entrypoints.server_dir
        gateway.entrypoints.api_server_proc gateway.entrypoints.api_servers
        gateway.engine.ray_engines""",
    # The scheduler and the executor (and `serve --headless`, which launches worker ranks).
    ENGINE_CORE: """gateway.engine.core gateway.engine.core_proc gateway.engine.scheduler
        gateway.engine.kv_cache_manager gateway.engine.block_pool gateway.engine.request
        gateway.engine.stats gateway.engine.structured_output
        gateway.engine.structured_output.manager gateway.engine.structured_output.xgrammar_backend
        gateway.engine.headless gateway.executor gateway.executor.mp gateway.executor.uni
        gateway.engine.front_ends gateway.executor.ray""",
    # The torch side: the model, the sampler and the logits processors.
    WORKER: """gateway.worker.worker gateway.worker.worker_proc gateway.worker.distributed
        gateway.worker.shm_comm gateway.worker.model_runner gateway.worker.input_batch
        gateway.worker.pooling_runner gateway.worker.sampler gateway.worker.sampling_ops
        gateway.worker.sampling_rows gateway.worker.logits_processors gateway.models.llama
        gateway.models.bert gateway.models.roberta gateway.models.classifier
        gateway.models.attention gateway.models.cpu_linear
        gateway.models.loader gateway.models.parallel gateway.models.gguf_weights
        gateway.worker.logprobs gateway.worker.penalties gateway.worker.cpu_threads
        gateway.worker.grammar_bitmask gateway.worker.ray_worker
        gateway.models.gguf_quant gateway.models.quant_linear gateway.models.quantized
        gateway.models.cpu_quant_kernels gateway.models.lone_decode
        gateway.models.decoder gateway.models.sliding_window""",
}.items() for module in modules.split()}

MAY_IMPORT = {
    SHARED: {SHARED},
    FRONT_END: {FRONT_END, SHARED},
    # With one device (the `uni` executor) the worker runs inside the engine-core process.
    ENGINE_CORE: {ENGINE_CORE, WORKER, SHARED},
    WORKER: {WORKER, SHARED},
}
# Imports across processes on purpose, each with its reason.
CROSSINGS = {
    ("gateway.engine.client", "gateway.engine.core_proc"):
        "names the engine core's spawn target (core_proc imports nothing heavy)",
    ("gateway.engine.ray_engines", "gateway.engine.core_proc"):
        "names the engine-core Ray actor's class (core_proc imports nothing heavy)",
    ("gateway.entrypoints.api_servers", "gateway.engine.core_proc"):
        "the supervisor of several API servers spawns the engine core itself",
    ("gateway.entrypoints.cli.serve", "gateway.engine.headless"):
        "`serve --headless` runs the worker-rank launcher instead of the server",
    ("gateway", "gateway.entrypoints.llm"): "`gateway.LLM`, imported on first use",
    ("gateway.plugins", "gateway.engine.output_processor"):
        "RequestOutput for plugin authors, imported on first use",
}
HTTP = ("fastapi", "starlette", "uvicorn")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import outside `if TYPE_CHECKING:`."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in PROCESS_OF]
            found.extend((name, top) for name in subs or [node.module])
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return found


MODULES = {_module_name(path): path for path in ROOT.rglob("*.py")}


def test_every_module_is_placed_in_a_process():
    assert sorted(set(MODULES) - set(PROCESS_OF)) == []
    assert sorted(set(PROCESS_OF) - set(MODULES)) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_modules_of_its_own_process(module):
    process = PROCESS_OF[module]
    wrong = [f"{name} ({PROCESS_OF[name]})" for name, _top in _imports(MODULES[module])
             if name in PROCESS_OF and PROCESS_OF[name] not in MAY_IMPORT[process]
             and (module, name) not in CROSSINGS]
    assert wrong == [], f"{module} ({process}) imports {wrong}"


@pytest.mark.parametrize("module", sorted(m for m, p in PROCESS_OF.items()
                                          if p in (FRONT_END, SHARED)))
def test_front_end_and_shared_modules_never_import_torch_at_import_time(module):
    front_end = PROCESS_OF[module] == FRONT_END
    torch = [name for name, top in _imports(MODULES[module])
             if name.split(".")[0] == "torch" and (top or front_end)]
    assert torch == []


@pytest.mark.parametrize("module", sorted(m for m, p in PROCESS_OF.items() if p == WORKER))
def test_worker_modules_never_import_the_http_layer(module):
    http = [name for name, _top in _imports(MODULES[module])
            if name.split(".")[0] in HTTP or name.startswith("gateway.entrypoints")]
    assert http == []
