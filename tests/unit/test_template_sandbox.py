"""The bounded call (kvpersist/system/forked.py call_bounded) that renders chat templates:
every way a call can fail ends in a BoundedCallError saying which, within its bounds, C-level
work included; and the probe rendered in the forked child is byte for byte what it was in
process, so no digest of a template that rendered before changes."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import time

import pytest

from kvpersist.config.chat_template import (
    render_here,
    render_probe,
    render_probe_bytes,
    template_sha256,
)
from kvpersist.demo.model import CHAT_TEMPLATE
from kvpersist.errors import ConfigError
from kvpersist.system.forked import BoundedCallError, call_bounded

# --------------------------------------------------------------------------- the bounds


def test_the_result_comes_back_and_nothing_else_does() -> None:
    seen: list[str] = []

    def work() -> bytes:
        seen.append("in the child")
        return b"\x00result\xff" * 1000

    assert call_bounded(work) == b"\x00result\xff" * 1000
    assert seen == []  # the child's changes stay in the child


def test_the_child_runs_under_a_cpu_and_an_address_space_limit() -> None:
    def limits() -> bytes:
        cpu = resource.getrlimit(resource.RLIMIT_CPU)
        space = resource.getrlimit(resource.RLIMIT_AS)[0]
        return f"{cpu[0]} {cpu[1]} {space}".encode()

    soft, hard, space = (int(x) for x in call_bounded(limits, seconds=0.5).split())
    assert (soft, hard) == (2, 3)  # whole seconds, one more than the wall-clock bound
    assert 0 < space < (1 << 40)


@pytest.mark.parametrize(("work", "why"), [
    (lambda: str(1 / 0).encode(), "ZeroDivisionError: division by zero"),
    # 300 MiB: more than the child may map, far less than this machine has
    (lambda: b"x" * (300 << 20), "needed more than the 256 MiB of memory"),
    (lambda: b"x" * ((1 << 20) + 1), "returned more than 1,048,576 bytes"),
    (lambda: os._exit(3), "exit status 3"),
    (lambda: os.kill(os.getpid(), signal.SIGTERM) or b"", "killed by signal SIGTERM"),
], ids=["exception", "memory", "too-big", "exit", "signal"])
def test_every_way_of_failing_says_which(work: object, why: str) -> None:
    with pytest.raises(BoundedCallError, match=why):
        call_bounded(work)  # type: ignore[arg-type]


def spin() -> bytes:
    """A Python loop that never ends."""
    n = 0
    while n >= 0:
        n += 1
    return b""


def big_power() -> bytes:
    """Minutes of C-level work (a 100-million-digit integer): no signal handler runs in it."""
    return str(10 ** (10 ** 8) % 7).encode()


def my_children() -> set[int]:
    """The pids whose parent is this process (zombies included), from /proc."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                out.add(int(name))
    return out


@pytest.mark.parametrize("work", [spin, big_power], ids=["python-loop", "big-int-power"])
def test_endless_work_is_stopped_by_the_wall_clock_and_reaped(work: object) -> None:
    before = my_children()
    start = time.monotonic()
    with pytest.raises(BoundedCallError, match=r"still running after 0\.5 s"):
        call_bounded(work, seconds=0.5)  # type: ignore[arg-type]
    assert time.monotonic() - start < 3
    assert my_children() <= before  # killed and reaped: not even a zombie


# --------------------------------------------------------------------------- the digests

#: a Llama-3-style template: system message handling, trim filters, date, header tokens
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ('user', 'assistant') %}
        {{- raise_exception("roles must be user or assistant") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
BLOCKS = "{% for m in messages %}\n{{ m.role }}: {{ m.content }}\n{% endfor %}\n" \
         "{% if add_generation_prompt %}assistant:{% endif %}\n"


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA3, BLOCKS, "{{ messages|tojson }}",
                                      "{{ 'é' * 3 }}{{ bos_token }}{{ eos_token }}"],
                         ids=["cpu-demo", "llama3", "blocks", "tojson", "unicode"])
def test_the_child_renders_what_the_process_did(template: str) -> None:
    here = render_here(template)
    assert render_probe(template) == here
    assert template_sha256(template) == hashlib.sha256(here.encode("utf-8")).hexdigest()


def test_line_ends_do_not_change_a_digest() -> None:
    """Jinja reads \\r\\n, \\r and \\n as one line end: template-sha reads a file's bytes as
    they are and derive reads template files as transformers does (\\r\\n made \\n), and
    both give one digest."""
    for template in (LLAMA3, BLOCKS):
        digest = template_sha256(template)
        assert template_sha256(template.replace("\n", "\r\n")) == digest
        assert template_sha256(template.replace("\n", "\r")) == digest


def test_a_failure_names_the_source() -> None:
    with pytest.raises(ConfigError) as err:
        render_probe_bytes("{{ 1 / 0 }}", "/m/chat_template.jinja")
    (problem,) = err.value.problems
    assert problem.where == "/m/chat_template.jinja"
    assert problem.message == "does not render: ZeroDivisionError: division by zero"
