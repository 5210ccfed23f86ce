"""Chat-template token framing, derived from the tokenizer's own template (no model family hard-coded).

The policy's sampled ids are kept as they are; only the environment's text is tokenized, wrapped in the
delimiters the template puts between an assistant turn and the next user turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# AgentGym's conversation start (env.prompt=agentgym): the instruction and the reply format as the user's first
# turn, the assistant's acknowledgement, then the first observation; the wording here is ours, the shape theirs
AGENTGYM_FORMAT = ("Your response should use the following format:\n\nThought:\nyour thoughts about the current "
                   "state\n\nAction:\nyour next action")
AGENTGYM_ACK = "OK"
PROMPT_STYLES = ("default", "agentgym")

_PROBE_REPLY = "\x00REPLY\x00"
_PROBE_OBS = "\x00OBS\x00"


@dataclass
class ChatFormat:
    tokenizer: Any
    close_reply: str = ""  # text between the assistant's content and the next user content, before the obs
    open_reply: str = ""  # text after the obs, up to where the assistant starts writing
    eos_text: str = ""
    style: str = "default"  # how an episode's conversation starts (PROMPT_STYLES; ``prompt_ids``)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, style: str = "default") -> "ChatFormat":
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": _PROBE_REPLY}]
        full = tokenizer.apply_chat_template(base + [{"role": "user", "content": _PROBE_OBS}],
                                             add_generation_prompt=True, tokenize=False)
        i = full.find(_PROBE_REPLY)
        j = full.find(_PROBE_OBS)
        if i < 0 or j < 0 or j < i:
            raise ValueError("cannot derive the turn delimiters from this tokenizer's chat template")
        close_reply = full[i + len(_PROBE_REPLY):j]
        open_reply = full[j + len(_PROBE_OBS):]
        eos_text = tokenizer.eos_token or ""
        if style not in PROMPT_STYLES:
            raise ValueError(f"unknown prompt style {style!r}; expected one of {PROMPT_STYLES}")
        return cls(tokenizer, close_reply, open_reply, eos_text, style)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, system: str, user: str) -> list[int]:
        """An episode's opening: the instruction ``system`` and the first observation ``user``, up to where the
        assistant starts writing. Style ``default``: a system message and a user turn; ``agentgym``: AgentGym's
        conversation start (the instruction with the Thought/Action format as a user turn, an "OK" assistant
        turn, then the observation as the next user turn)."""
        if self.style == "agentgym":
            msgs = [{"role": "user", "content": f"{system}\n\n{AGENTGYM_FORMAT}"},
                    {"role": "assistant", "content": AGENTGYM_ACK}, {"role": "user", "content": user}]
        else:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def window_prompt_ids(self, system: str, observations: list[str], actions: list[list[int]],
                          stopped: list[bool], k: int) -> list[int]:
        """The prompt of turn ``t = len(actions)`` under a history window of ``k`` turns: the instruction, the
        last ``k`` turns (each reply's ids as sampled, then the observation that followed it) and the current
        observation ``observations[t]``. The earliest turn shown opens the user message; when turns were left
        out, a note says how many. For ``t <= k`` this is exactly the full-history sequence (``prompt_ids`` of
        the first observation, then reply and ``env_turn_ids`` alternately), so a window never changes the first
        ``k`` turns."""
        t = len(actions)
        if len(observations) != t + 1 or len(stopped) != t:
            raise ValueError(f"turn {t} needs {t + 1} observations and {t} stop flags, got {len(observations)} "
                             f"and {len(stopped)}")
        if k < 0:
            raise ValueError(f"history window k must be >= 0, got {k}")
        first = max(0, t - k)
        opening = observations[first] if first == 0 else f"[{first} earlier turns omitted]\n{observations[first]}"
        ids = self.prompt_ids(system, opening)
        for j in range(first, t):
            ids += list(actions[j])
            ids += self.env_turn_ids(observations[j + 1], stopped[j])
        return ids

    def env_turn_ids(self, observation: str, reply_ended_with_eos: bool) -> list[int]:
        """Tokens appended after a policy turn: close the assistant turn, the observation as a user turn,
        and open the next assistant turn. If the sampled reply already ended with the EOS token that
        closes a turn, that token is not repeated."""
        close = self.close_reply
        if reply_ended_with_eos and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]
        return self.encode(close + observation + self.open_reply)
