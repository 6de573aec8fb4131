"""The agent loop: one class for `tmax run`, `tmax bench` and `tmax learn`.

The prompt, the action parser, how an action runs and what the model sees of it come from
a harness (`agents.harness`); the default is Vanillux2, described here. mini-swe and
terminus-2 (`agents.harnesses`) share everything else: steps, format-error counting,
retries, budgets, records.

Vanillux2 semantics (the Tmax evaluation harness):

* messages start as [system, user(instance template)];
* every model call is one step, format errors included; at most `max_steps` per episode;
* only the first tool call is used; a command containing the submit marker runs and then
  the episode ends; the marker in any observation also ends it;
* a response without a valid `bash` call gets format-error feedback (a `user` message, or
  a `tool` reply when the bad call has a usable id); `max_format_errors` in a row end it;
* model errors are retried (5 attempts, back-off 2/4/8/16 s); auth / not-found /
  bad-request errors are not; a context overflow ends the episode cleanly (with compaction
  on: the session is compacted and the turn tried again, once);
* a sandbox failure is an infrastructure error (`sandbox_error`), never the agent's.

Ctrl-C during the model call or a command interrupts only that: the command is stopped
with `harness.interrupt()` (the shell survives) and `hooks.on_interrupt()` decides whether
to continue with guidance or stop.

`stop` (an Event that `agents.driver` sets at a deadline or on cancel) ends the episode as
`stopped` before the next model call, or as one returns (its command is then not run).

Compaction (`agents.compaction`, off unless `compaction` is set; `tmax run` sets it) happens
before a model call, when the request about to be sent (counted: `request_tokens`) would
reach the threshold or the user asked (`request_compaction`), and after the server refused a
request as too long; `compact()` also runs it between episodes. With it on, an output is
also cut to the room a compacted context leaves (saved whole as `outputs/step-N.txt`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from tmax.agents.budget import Budget, budget_hint
from tmax.agents.compaction import CompactionRecord, Compactor, ContextUse, SessionContext, turns_after_task
from tmax.agents.fitting import Clip, TokenCounter
from tmax.agents.harness import Harness, TmaxHarness
from tmax.agents.instructions import with_instructions
from tmax.agents.observation import ObservationLimits
from tmax.agents.parsing import Action
from tmax.agents.policy import Compactable, ContextOverflow, FatalModelError, ModelError, ModelTurn, Policy, Usage
from tmax.agents.prompts import REJECTED_TOOL_TEXT, render
from tmax.agents.recorder import Recorder, SavedRun, save_output
from tmax.agents.agent_settings import AgentSettings
from tmax.sandbox.base import CommandResult, Sandbox, SandboxError
from tmax.common.records import AgentStatus, StepTiming
from tmax.common.waiting import retry_call

INTERRUPT_TEMPLATE = "The user interrupted you and says: {{guidance}}"
REJECTION_TEMPLATE = "The user did not run your command and says: {{feedback}}"
WINDOW_CLIP_NOTE = ("[The output above was {{chars}} characters, more than fits the context window: only its head "
                    "and tail are shown. The whole output is saved as {{file}}. Run a command that prints less "
                    "(grep, head, tail, sed -n) to see the part you need.]")


class AgentHooks:
    """Callbacks for UIs and runners. Every method is optional."""

    def on_step_start(self, step: int) -> None: ...

    def on_model_turn(self, step: int, turn: ModelTurn, command: str | None) -> None: ...

    def approve(self, step: int, command: str) -> str | None:
        """None runs the command; any text rejects it and goes back to the model."""
        return None

    def on_observation(self, step: int, result: CommandResult, observation: str) -> None: ...

    def on_format_error(self, step: int, feedback: str, reason: str | None = None) -> None:
        """`feedback` is what the model is told; `reason` is what the parser found wrong."""

    def on_retry(self, attempt: int, error: Exception, delay_s: float) -> None: ...

    def on_interrupt(self) -> str | None:
        """Ctrl-C: guidance text to continue, None to stop."""
        return None

    def on_compaction_start(self, reason: str, context_tokens: int) -> None: ...

    def on_output_clipped(self, step: int, clip: Clip) -> None:
        """A command's output was cut to fit the context window (before `on_observation`)."""

    def on_compaction(self, record: CompactionRecord) -> None:
        """After a compaction, done (`record.ok`) or failed (the session is unchanged)."""


@dataclass
class AgentResult:
    status: AgentStatus
    steps: int
    usage: Usage
    messages: list[dict[str, Any]]
    error: str | None = None


@dataclass
class _Outcome:
    status: AgentStatus
    error: str | None = None


class Agent:
    def __init__(
        self,
        policy: Policy,
        sandbox: Sandbox,
        config: AgentSettings | None = None,
        recorder: Recorder | None = None,
        hooks: AgentHooks | None = None,
        *,
        harness: Harness | None = None,
        stop: threading.Event | None = None,
        sleep: Callable[[float], None] = time.sleep,
        instructions: str | None = None,
    ) -> None:
        self.policy = policy
        self.sandbox = sandbox
        self.config = config or AgentSettings()
        self.recorder = recorder
        self.hooks = hooks or AgentHooks()
        # What differs between agent styles (prompt, action parser, execution, observation).
        self.harness = harness or TmaxHarness()
        self.tools = self.harness.tools
        self.stop = stop or threading.Event()  # set from outside: end at the next step boundary
        self._sleep = sleep  # injectable so tests do not wait through real back-offs
        self.messages: list[dict[str, Any]] = []
        self.timing: list[StepTiming] = []
        self.usage = Usage()
        self.steps = 0  # model calls over the whole session (follow-ups included)
        self._last_context_tokens = 0
        self.instructions = instructions  # project instructions for the system prompt (`tmax run`)
        self.counter = TokenCounter()  # the size of a request before it is sent
        self.compactor = Compactor(self.config, self.counter)
        self.context = SessionContext()  # the task, the follow-ups and the compactions
        self._compact_request: str | None = None  # a focus ("" for none): compact at the next step
        self._format_errors_before = 0  # format errors in a row a continued conversation ended on

    # ---- public API -------------------------------------------------------------------

    def run(self, task: str) -> AgentResult:
        """A fresh episode: [system, user(instance template with the task)]."""
        if not task.strip():
            raise ValueError("the task text is empty")
        self.messages = with_instructions(self.harness.initial_messages(task), self.instructions)
        self.timing, self.usage, self.steps, self._last_context_tokens = [], Usage(), 0, 0
        self.counter.forget()
        self.context = SessionContext.of(self.messages)
        return self._episode()

    def follow_up(self, text: str) -> AgentResult:
        """Continue the same conversation and shell with a new user message."""
        if not self.messages:
            raise RuntimeError("follow_up() needs a conversation: call run() or load() first")
        self.messages.append({"role": "user", "content": text})
        self.context.follow_up_at.append(len(self.messages) - 1)
        return self._episode()

    def load(self, saved: SavedRun) -> None:
        """Adopt a saved conversation (`tmax run --resume`); then call follow_up()."""
        self.messages = [dict(m) for m in saved.messages]
        self.timing = list(saved.timing)
        self.usage = Usage(**vars(saved.usage))
        self.steps = saved.steps if saved.steps is not None else sum(1 for m in self.messages if m.get("role") == "assistant")
        self.context = saved.context or SessionContext.of(self.messages)
        self.counter.forget()

    def resume(self) -> AgentResult:
        """Continue an episode a stop ended (the stop cleared): the next model call answers the
        messages as they are. How a branch of a forked episode (`branch`) goes on."""
        if not self.messages:
            raise RuntimeError("resume() needs a conversation: call run() first")
        return self._episode()

    def continue_from(self, other: Agent) -> None:
        """Take `other`'s conversation as it is (messages, steps, usage, records of its turns,
        copied), to go on with `resume` under this agent's policy, sandbox and harness: one
        branch of a forked episode (its policy a copy of the token context, its sandbox a fork)."""
        import copy

        self.messages, self.timing = copy.deepcopy(other.messages), copy.deepcopy(other.timing)
        self.usage, self.steps = replace(other.usage), other.steps
        self.context, self._last_context_tokens = copy.deepcopy(other.context), other._last_context_tokens
        self.counter.forget()
        turns = [t for t in self.timing if t.step is not None]
        while turns and turns[-1].format_error:  # still in a row: they count toward the limit
            turns.pop()
            self._format_errors_before += 1

    # ---- compaction (agents.compaction) -----------------------------------------------

    @property
    def context_use(self) -> ContextUse:
        """How full the context window is (as of the last turn)."""
        return self.compactor.use(self.policy, self._last_context_tokens, self.context.segments)

    def request_compaction(self, focus: str | None = None) -> None:
        """Compact before the next model call (`/compact` while the loop runs)."""
        self._compact_request = focus or ""

    def request_tokens(self) -> int:
        """The size of the next request (`TokenCounter.next_request`), and at least the last
        turn's context as reported (the next prompt holds it)."""
        return max(self.counter.next_request(self.policy, self.messages, self.tools).tokens, self._last_context_tokens)

    def compact(self, focus: str | None = None,
                reason: Literal["auto", "manual", "overflow"] = "manual") -> CompactionRecord:
        """Compact now: between episodes, or from the loop at a step boundary. A failure
        leaves the conversation as it was; the record says why."""
        used = self.request_tokens()
        self.hooks.on_compaction_start(reason, used)
        t0 = time.monotonic()
        out = self.compactor.compact(self.policy, self.messages, self.tools, self.context, used,
                                     step=self.steps, reason=reason, focus=focus, ask=self._aside)
        if out.usage is not None:
            self.usage.add(out.usage)
        self.timing.append(StepTiming(compaction=out.record.segment, llm_s=round(time.monotonic() - t0, 3),
                                      ok=out.record.ok))
        if out.messages is not None and out.context is not None:
            if self.recorder is not None:
                self.recorder.close_segment(out.record.segment, self.messages, getattr(self.policy, "trace", None))
            assert isinstance(self.policy, Compactable)  # only such a policy's summary succeeds
            self.policy.restart(out.record.tokens_after or 0)
            self.counter.forget()
            self.messages, self.context = out.messages, out.context
            self._last_context_tokens = out.record.tokens_after or 0
        else:
            self.context.compactions.append(out.record)
        self._save()
        self.hooks.on_compaction(out.record)
        return out.record

    def _compact_if_due(self) -> None:
        """Before a model call: compact when asked or when the request would pass the threshold."""
        if self._compact_request is not None:
            focus, self._compact_request = self._compact_request, None
            self.compact(focus, "manual")
        if not self.compactor.active(self.policy):
            return  # nothing is counted: the Vanillux2 protocol (bench, learn) as it is
        # Only once the model has answered since the task (or the last compaction) is there anything
        # to summarise. A request still too long goes out: the policy or the server refuses it (`_overflowed`).
        if turns_after_task(self.messages) and self.compactor.due(self.policy, self.request_tokens()):
            self.compact(None, "auto")

    def _overflowed(self, error: ContextOverflow, retried: bool) -> "_Outcome | None":
        """The server refused the request as too long (its count is not ours, or its window
        was not known): compact and retry the turn, once; an outcome when that cannot help."""
        why = str(error)
        if error.prompt_tokens:  # the server's count of this request: estimates scale by it from now on
            self.counter.calibrate(self.messages, self.tools, error.prompt_tokens)
        if self.compactor.active(self.policy) and not retried:
            record = self.compact(None, "overflow")
            if record.ok:
                return None
            why = f"{why} (compaction failed: {record.error})"
        too_large = self.compactor.too_large(self.policy, self.messages, self.tools, self.context) \
            if self.compactor.active(self.policy) else None
        return _Outcome(AgentStatus.CONTEXT_OVERFLOW, f"{why}; {too_large}" if too_large else why)

    def _aside(self, messages: list[dict[str, Any]], max_tokens: int) -> ModelTurn:
        cfg, policy = self.config, self.policy
        assert isinstance(policy, Compactable)  # the compactor asks only such a policy
        return retry_call(lambda: policy.complete_aside(messages, self.tools, max_tokens),
                          attempts=cfg.retries, backoff_s=cfg.backoff_s, retry_on=ModelError,
                          on_retry=self.hooks.on_retry, sleep=self._sleep)

    # ---- the loop ---------------------------------------------------------------------

    def _episode(self) -> AgentResult:
        try:
            outcome = self._steps()
        finally:
            # Also when a hook aborts the episode with an exception.
            self._save()
        if self.recorder is not None:
            self.recorder.finish(outcome.status, self.steps, outcome.error)
        return AgentResult(outcome.status, self.steps, self.usage, self.messages, outcome.error)

    def _steps(self) -> _Outcome:
        cfg = self.config
        episode_steps = 0
        format_errors, self._format_errors_before = self._format_errors_before, 0
        started = time.monotonic()
        retried = False  # this turn was already retried after an overflow
        while True:
            if self.stop.is_set():
                return _Outcome(AgentStatus.STOPPED)
            if episode_steps >= cfg.max_steps:
                return _Outcome(AgentStatus.MAX_STEPS)
            self._compact_if_due()
            guard = not getattr(self.policy, "enforces_context_budget", False)
            if guard and self._last_context_tokens >= cfg.context_budget:
                return _Outcome(AgentStatus.CONTEXT_OVERFLOW, f"context budget of {cfg.context_budget} tokens used")
            step = self.steps + 1
            self.hooks.on_step_start(step)
            t0 = time.monotonic()
            try:
                turn = self._query()
            except KeyboardInterrupt:
                if not self._guidance():
                    return _Outcome(AgentStatus.INTERRUPTED)
                continue
            except ContextOverflow as e:
                ended = self._overflowed(e, retried)
                if ended is not None:
                    return ended
                retried = True
                continue
            except FatalModelError as e:
                return _Outcome(AgentStatus.MODEL_ERROR, str(e))
            except ModelError as e:
                return _Outcome(AgentStatus.MODEL_ERROR, f"giving up after {cfg.retries} attempts: {e}")
            llm_s = time.monotonic() - t0
            retried = False
            self.steps = step
            episode_steps += 1
            self.usage.add(turn.usage)
            self._last_context_tokens = turn.usage.context_tokens
            if isinstance(self.policy, Compactable):  # /compact works with automatic compaction off too
                self.counter.calibrate(self.messages, self.tools, turn.usage.prompt_tokens, turn.usage.completion_tokens)
            if self.compactor.active(self.policy):
                self._last_context_tokens = self._last_context_tokens or self.request_tokens()
            if self.stop.is_set():  # the answer came after the stop: nothing of it runs
                return _Outcome(AgentStatus.STOPPED)

            message = dict(turn.message)
            action = self.harness.parse(message)
            self.hooks.on_model_turn(step, turn, action.command)

            if action.is_format_error:
                format_errors += 1
                self._format_error(step, message, action, llm_s)
                if format_errors >= cfg.max_format_errors:
                    return _Outcome(AgentStatus.FORMAT_ERRORS, f"{format_errors} format errors in a row")
                continue
            format_errors = 0
            # Only the first call is answered; drop the rest so the history stays valid.
            if message.get("tool_calls"):
                message["tool_calls"] = message["tool_calls"][:1]
            self.messages.append(message)
            assert action.command is not None

            gate = self._gate(step, action, llm_s)
            if isinstance(gate, _Outcome):
                return gate
            if gate:
                outcome = self._act(step, action, llm_s, episode_steps, started)
                if outcome is not None:
                    return outcome

    def _gate(self, step: int, action: Action, llm_s: float) -> "_Outcome | bool":
        """Ask the hooks to approve the command: True runs it, False skips it (rejected, or
        guidance after a Ctrl-C at the prompt), an outcome ends the episode."""
        assert action.command is not None
        try:
            rejection, quit_ = self.hooks.approve(step, action.command), False
        except KeyboardInterrupt:
            # Quit or Ctrl-C at the approval prompt: the call still gets an answer so the
            # saved history stays valid for --resume, then the user decides.
            rejection, quit_ = None, True
        if rejection is None and not quit_:
            return True
        self._reply(action, REJECTED_TOOL_TEXT, tool_only=True)
        if rejection is not None:
            self.messages.append({"role": "user", "content": render(REJECTION_TEMPLATE, feedback=rejection)})
        self.timing.append(StepTiming(step=step, llm_s=round(llm_s, 3), rejected=True, cmd=action.command[:200]))
        self._save()
        return _Outcome(AgentStatus.INTERRUPTED) if quit_ and not self._guidance() else False

    def _act(self, step: int, action: Action, llm_s: float, episode_steps: int, started: float) -> "_Outcome | None":
        """Run the approved command and answer the call; an outcome when the episode ends."""
        cfg = self.config
        assert action.command is not None
        try:
            result, interrupted = self._execute(action)
        except SandboxError as e:
            self.timing.append(StepTiming(step=step, llm_s=round(llm_s, 3), sandbox_error=str(e)[:200],
                                          cmd=action.command[:200]))
            return _Outcome(AgentStatus.SANDBOX_ERROR, str(e))
        limits = self._observation_limits()
        observation, finished = self.harness.observe(action, result, limits)
        total = len(result.output or "") + len(result.stderr or "") + result.dropped_chars
        if limits.max_chars < cfg.observation_max_chars and total > limits.max_chars:
            observation += self._clipped(step, result, total, limits.max_chars)
        if cfg.budget_hints:
            observation += budget_hint(Budget(cfg.max_steps, episode_steps, cfg.context_budget,
                                              self._last_context_tokens, time.monotonic() - started, cfg.time_budget_s))
        self._reply(action, observation)
        # A command's round trip to 0.1 ms: a short one takes 1-4 ms, where whole milliseconds
        # would hide the difference between two sandboxes (benchmarks/latency_parity.py).
        self.timing.append(StepTiming(step=step, llm_s=round(llm_s, 3), bash_s=round(result.duration_s, 4),
                                      return_code=result.exit_code, cmd=action.command[:200]))
        self.hooks.on_observation(step, result, observation)
        self._save()
        if interrupted:
            # The user stopped this command; their guidance (if any) comes before any submit.
            return None if self._guidance() else _Outcome(AgentStatus.INTERRUPTED)
        return _Outcome(AgentStatus.SUBMITTED) if finished else None

    def _observation_limits(self) -> ObservationLimits:
        """What the model may see of an output: the configured limits, or less where a
        compacted context would leave less room in the window (`Compactor.observation_room`)."""
        limits = self.config.observation_limits
        room = self.compactor.observation_room(self.policy, self.messages, self.tools, self.context)
        if room is None:
            return limits
        chars = max(200, self.counter.chars_for(room))
        return limits if chars >= limits.max_chars else ObservationLimits(chars, chars // 2, chars - chars // 2)

    def _clipped(self, step: int, result: CommandResult, total: int, kept: int) -> str:
        """An output cut to fit the window: saved whole (`outputs/step-N.txt`), the hooks told,
        and the note the model gets."""
        text = "\n".join(part for part in (result.output, result.stderr) if part)
        file = save_output(self.recorder.dir, step, text) if self.recorder is not None else None
        where = f"outputs/step-{step}.txt in the session's records" if file is not None else "nowhere (no records)"
        self.hooks.on_output_clipped(step, Clip(where=f"step {step}", chars=total, kept=kept,
                                                file=str(file) if file is not None else None))
        return "\n\n" + render(WINDOW_CLIP_NOTE, chars=f"{total:,}", file=where)

    def _query(self) -> ModelTurn:
        cfg = self.config
        return retry_call(lambda: self.policy.complete(self.messages, self.tools), attempts=cfg.retries,
                          backoff_s=cfg.backoff_s, retry_on=ModelError, on_retry=self.hooks.on_retry, sleep=self._sleep)

    def _format_error(self, step: int, message: dict[str, Any], action: Action, llm_s: float) -> None:
        feedback = self.harness.format_error(action)
        if message.get("content") is None:
            message["content"] = ""
        if action.tool_call_id:
            # The call was well-formed but wrong (e.g. another tool): answer it as a tool reply.
            message["tool_calls"] = message["tool_calls"][:1]
            self.messages.append(message)
            self.messages.append({"role": "tool", "tool_call_id": action.tool_call_id, "content": feedback})
        else:
            # Unusable calls are dropped so later requests never re-send broken arguments.
            message.pop("tool_calls", None)
            self.messages.append(message)
            self.messages.append({"role": "user", "content": feedback})
        self.timing.append(StepTiming(step=step, llm_s=round(llm_s, 3), format_error=True, reason=action.error))
        self.hooks.on_format_error(step, feedback, action.error)
        self._save()

    def _reply(self, action: Action, text: str, tool_only: bool = False) -> None:
        """Answer the call: a `tool` message for a native call, else (raw-text call) a user message."""
        if action.tool_call_id:
            self.messages.append({"role": "tool", "tool_call_id": action.tool_call_id, "content": text})
        elif not tool_only:
            self.messages.append({"role": "user", "content": text})

    def _execute(self, action: Action) -> tuple[CommandResult, bool]:
        """Run the command in a worker thread so Ctrl-C reaches this (main) thread, which
        then interrupts the command and waits for the shell to come back."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["result"] = self.harness.execute(self.sandbox, action, self.config.command_timeout)
            except BaseException as e:  # handed to the main thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="tmax-command", daemon=True).start()
        interrupts = 0
        while not done.is_set():
            try:
                done.wait(0.05)
            except KeyboardInterrupt:
                interrupts += 1
                # A second Ctrl-C means the command ignored the first: kill its whole group.
                self.harness.interrupt(self.sandbox, force=interrupts > 1)
        if "error" in box:
            err = box["error"]
            if isinstance(err, SandboxError):
                raise err
            raise SandboxError(f"the sandbox failed while running a command: {err!r}") from err
        return box["result"], interrupts > 0

    def _guidance(self) -> bool:
        guidance = self.hooks.on_interrupt()
        if guidance is None:
            return False
        self.messages.append({"role": "user", "content": render(INTERRUPT_TEMPLATE, guidance=guidance)})
        self._save()
        return True

    def _save(self) -> None:
        if self.recorder is not None:
            self.recorder.save(self.messages, self.timing, self.usage, self.config.max_steps,
                               trace=getattr(self.policy, "trace", None), steps=self.steps, context=self.context_use,
                               session=self.context if self.context.kept else None)
