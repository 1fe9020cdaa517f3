"""SupportDesk-v0: a support desk with a simulated customer on the other side of the chat.

The customer writes first; the agent must ask for what it needs (email, order number, refund
preference) through ``ask_customer``, look things up, follow the written policy
(:data:`envs.support.world.POLICY`) and change orders only as the policy allows. The customer
holds a hidden persona and goal; some push for exceptions, some misremember dates.

**Reward** (a function of the final state of the world, never of the wording)::

    R = 0.8 * state + 0.2 * procedure - 0.01 per invalid call (at most 0.05)

``state`` is 1 when the orders changed by the episode's successful ``cancel_order`` /
``return_order`` calls equal the changes the policy asks for (:func:`expected_changes`);
``procedure`` is 1 when every change was made on an order of a customer looked up by email
before it, and confirmed by the customer's explicit yes in the last reply before it. Without
``end_conversation`` every term is 0. Success (pass^k's unit) is ``state == procedure == 1``.
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar, Literal

from pydantic import Field

from envs.support.customer import LLMCustomer, RuleCustomer, is_yes, opening_message
from envs.support.world import CYCLE, POLICY, build_world, expected_changes, make_goal
from rewards import Reward, Scored, invalid_call_penalty, submitted_gate, term
from twin import Case, ToolError, Trajectory, Twin, TwinConfig, tool

__all__ = ["SupportDeskConfig", "SupportDeskTwin", "final_changes", "support_reward"]

WRITE_TOOLS = ("cancel_order", "return_order")


# -- reward ------------------------------------------------------------------------------------
def final_changes(trajectory: Trajectory) -> dict[str, dict[str, Any]]:
    """The order changes the episode made: its successful write calls, applied in order."""
    changes: dict[str, dict[str, Any]] = {}
    for c in trajectory.calls:
        if c.ok and c.name in WRITE_TOOLS and isinstance(c.result, dict):
            change = {"status": c.result["status"]}
            if c.result.get("refund_to"):
                change["refund_to"] = c.result["refund_to"]
            changes[str(c.result["order_id"])] = change
    return changes


def _procedure_problems(trajectory: Trajectory) -> list[str]:
    verified: set[str] = set()
    last_reply, last_ask = "", ""
    problems = []
    for c in trajectory.calls:
        if not c.ok:
            continue
        if c.name == "find_customer" and isinstance(c.result, dict):
            verified.add(str(c.result.get("customer_id")))
        elif c.name == "ask_customer" and isinstance(c.result, dict):
            last_ask, last_reply = (
                str((c.arguments or {}).get("message", "")),
                str(c.result.get("customer", "")),
            )
        elif c.name in WRITE_TOOLS and isinstance(c.result, dict):
            oid = c.result["order_id"]
            if c.result.get("customer_id") not in verified:
                problems.append(f"{c.name} {oid}: the customer was not looked up by email first")
            if not (is_yes(last_reply) and last_ask):
                problems.append(f"{c.name} {oid}: no explicit yes from the customer just before")
            last_reply = ""  # one yes confirms one change
    return problems


@term(low=0.0, high=1.0)
def state(trajectory: Trajectory, case: Case) -> Scored:
    """1 when the final order changes are exactly the ones the policy asks for."""
    got, want = final_changes(trajectory), case.truth["changes"]
    return Scored(
        float(got == want), f"state: changed {got or 'nothing'}; policy: {want or 'nothing'}"
    )


@term(low=0.0, high=1.0)
def procedure(trajectory: Trajectory, case: Case) -> Scored:
    """1 when every change followed identity look-up and an explicit yes (1 with no change)."""
    problems = _procedure_problems(trajectory)
    return Scored(float(not problems), "; ".join(problems) or "procedure: followed")


support_reward = Reward(
    {state: 0.8, procedure: 0.2},
    penalties=[invalid_call_penalty(0.01, cap=0.05)],
    gates=[submitted_gate()],
    clip=(-0.05, 1.0),
    name="support",
)


# -- the twin ----------------------------------------------------------------------------------
class SupportDeskConfig(TwinConfig):
    """Options of SupportDesk.

    Attributes:
        customer: ``rules`` (the deterministic simulator) or a policy spec for an LLM customer
            (``openai:MODEL``, ``hf:...``).
        customer_base_url: Server root of an ``openai:`` customer (default ``$OPENAI_BASE_URL``).
        customer_max_tokens: Most tokens per LLM customer reply.
        customer_timeout: Seconds per LLM customer reply.
    """

    max_turns: int = Field(16, ge=1)
    customer: str = "rules"
    customer_base_url: str | None = None
    customer_max_tokens: int = Field(96, ge=1)
    customer_timeout: float = Field(60.0, gt=0)


class SupportDeskTwin(Twin):
    """An online shop's support desk; the customer is simulated (see the module docstring)."""

    name = "SupportDesk"
    version = 0
    description = (
        "Support desk with a simulated customer: ask for details, look up the customer "
        "and order, follow the written policy, cancel / return or decline."
    )
    config_model = SupportDeskConfig
    splits: ClassVar[dict[str, int]] = {"train": 6_000, "dev": 120, "test": 120}
    reward = support_reward

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        cfg: SupportDeskConfig = self.config  # type: ignore[assignment]
        if cfg.customer == "rules":
            self.customer: Any = RuleCustomer()
        else:
            self.customer = LLMCustomer(
                cfg.customer, cfg.customer_base_url, cfg.customer_max_tokens, cfg.customer_timeout
            )
            self.blocking_tools = True  # a reply waits on a model: runners step in threads

    def world_key(self) -> str:
        """Only the seed makes the world (the customer and limits change episodes, not data)."""
        return json.dumps({"seed": self.config.seed})

    def build_world(self) -> Any:
        return build_world(self.config.seed)

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        kind = CYCLE[index % len(CYCLE)]  # half act, half decline; the rng picks customer and order
        goal = make_goal(self.world, rng, kind, split)
        # The persona and goal sit in the task, which only the tools read (ask_customer plays the
        # customer from it); the prompt shows the opening message alone.
        task = {"message": opening_message(goal), "customer": goal}
        return kind, task, {"changes": expected_changes(goal), "customer_id": goal["customer_id"]}

    def prompt(self, case: Case) -> list[dict[str, Any]]:
        system = (
            "You are a customer support agent of an online shop. Talk to the customer only "
            "through ask_customer; use the tools to look things up and act. Follow this "
            f"policy:\n\n{POLICY}\nCall tools as "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
        )
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": case.task["message"]},
        ]

    def new_state(self, case: Case) -> dict[str, Any]:
        return {"history": [], "changes": {}}

    def outcome(self, trajectory: Trajectory, case: Case) -> dict[str, Any]:
        return {
            "truth": {"changes": case.truth["changes"]},
            "kind": case.kind,
            "changes": final_changes(trajectory),
        }

    def success(self, trajectory: Trajectory) -> bool:
        """pass^k's unit: the final state and the procedure are both right."""
        return (
            trajectory.components.get("state") == 1.0
            and trajectory.components.get("procedure") == 1.0
        )

    # -- tools -------------------------------------------------------------------------------
    @tool
    def ask_customer(self, message: str, state: dict, task: dict) -> dict:
        """Say something to the customer and get their reply.

        Args:
            message: Your message to the customer (a question, an explanation or a confirmation).
        """
        if not message.strip():
            raise ToolError("message is empty; write what you want to say to the customer")
        reply = self.customer.reply(task["customer"], state["history"], message[:2000])
        state["history"].append({"agent": message[:2000], "customer": reply})
        return {"customer": reply}

    @tool
    def find_customer(self, email: str, world: dict) -> dict:
        """Look a customer up by the email address on their account.

        Args:
            email: The email address the customer gave you.
        """
        cid = world["by_email"].get(email.strip().lower())
        if cid is None:
            raise ToolError(
                f"no customer with email {email!r}; ask the customer for the email on their account"
            )
        person = world["customers"][cid]
        return {"customer_id": cid, "name": person["name"], "orders": list(person["orders"])}

    @tool
    def get_order(self, order_id: str, world: dict, state: dict) -> dict:
        """Look an order up.

        Args:
            order_id: The order number, e.g. "#W50012" (ask the customer for it).
        """
        order = world["orders"].get(order_id.strip())
        if order is None:
            raise ToolError(f"no order {order_id!r}; order numbers look like '#W50012'")
        return {**order, **state["changes"].get(order["order_id"], {})}

    @tool
    def read_policy(self) -> str:
        """The support desk's written policy."""
        return POLICY

    @tool
    def cancel_order(self, order_id: str, world: dict, state: dict) -> dict:
        """Cancel an order that has not shipped yet.

        Args:
            order_id: The order to cancel.
        """
        order = self._current(order_id, world, state)
        if order["status"] != "processing":
            raise ToolError(
                f"order {order['order_id']} is {order['status']}; "
                "only processing orders can be cancelled"
            )
        change = {"status": "cancelled"}
        state["changes"][order["order_id"]] = change
        return {"order_id": order["order_id"], "customer_id": order["customer_id"], **change}

    @tool
    def return_order(
        self,
        order_id: str,
        refund_to: Literal["original", "store_credit"],
        world: dict,
        state: dict,
    ) -> dict:
        """Open a return for a delivered order and refund it.

        Args:
            order_id: The order to return.
            refund_to: "original" (the original payment method) or "store_credit".
        """
        order = self._current(order_id, world, state)
        if order["status"] != "delivered":
            raise ToolError(
                f"order {order['order_id']} is {order['status']}; "
                "only delivered orders can be returned"
            )
        change = {"status": "return_requested", "refund_to": refund_to}
        state["changes"][order["order_id"]] = change
        return {"order_id": order["order_id"], "customer_id": order["customer_id"], **change}

    @tool(terminal=True)
    def end_conversation(self, summary: str) -> dict:
        """End the conversation once the request is handled or declined; ends the episode.

        Args:
            summary: One sentence: what you did for the customer.
        """
        return {"ended": True}

    def _current(self, order_id: str, world: dict, state: dict) -> dict[str, Any]:
        order = world["orders"].get(order_id.strip())
        if order is None:
            raise ToolError(f"no order {order_id!r}; order numbers look like '#W50012'")
        return {**order, **state["changes"].get(order["order_id"], {})}

    # -- policies and twin check hooks -------------------------------------------------------
    def baselines(self) -> dict[str, Any]:
        from envs.support.agents import CarefulAgent, HeuristicAgent

        return {
            "careful": lambda twin: CarefulAgent(),
            "heuristic": lambda twin: HeuristicAgent(),
            "oracle": lambda twin: CarefulAgent(name="oracle"),
        }

    def reference_policies(self) -> dict[str, Any]:
        from envs.support.agents import CarefulAgent

        return {"careful": CarefulAgent()}

    def case_label(self, case: Case) -> str:
        """The change the policy asks for: cancel, return or none."""
        changes = case.truth["changes"]
        return next(iter(changes.values()))["status"] if changes else "none"

    def world_entities(self, split: str, limit: int | None = None) -> dict[str, set[str]]:
        """The customers the first ``limit`` cases of ``split`` are about."""
        count = self.num_cases(split) if limit is None else min(limit, self.num_cases(split))
        return {"customers": {self.case(split, i).truth["customer_id"] for i in range(count)}}
