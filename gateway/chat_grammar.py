"""A chat answer's grammar: a call tool_choice forces, a response format, and an open thinking section (closed
first, at once or within a thinking budget). Pure text."""

from gateway.schemas import ApiError, GenerationParams
from gateway.structured_outputs import Constraint
from gateway.tool_calls import forced_calls, json_expression, lark_tag

JSON_KINDS = ("json_schema", "json_object")
CLOSE = "</think>"


def chat_grammar(params: GenerationParams, constraint: Constraint | None, call_format,
                 tags: frozenset[str]) -> Constraint | None:
    """The constraint to compile for a chat answer (None: unconstrained); params.thinking is set to None where the
    answer is then not split into reasoning.

    - A forced call (tool_choice "required" or named) in the model's format; with a response format: a 400.
    - Where the prompt left a thinking section open (params.thinking), a forced call or a JSON answer comes after
      the section is closed: at once, or, with params.thinking_budget, after free thinking (the verify worker
      forces </think> at the budget: GenerationRequest.thinking_end). A regex, choice or grammar constraint applies
      from the first token instead, and the answer is not split (with a budget: a 400).
    """
    calls = forced_calls(call_format, params.tools, tags) if params.tools is not None else None
    if calls is not None and constraint is not None:
        raise ApiError(400, "a forced tool call (tool_choice) and a response format cannot both constrain one answer",
                       param="tool_choice")
    budget = params.thinking_budget if params.thinking else None
    if budget is not None and CLOSE not in tags:
        raise ApiError(400, f"'thinking_token_budget' needs {CLOSE} as one token of the tokenizer, and this model's "
                       "tokenizer spells it in pieces", param="thinking_token_budget")
    if params.thinking:
        if calls is not None:
            body = calls
        elif constraint is not None and constraint.kind in JSON_KINDS:
            body = (json_expression(constraint), "")
        elif constraint is not None:
            if budget is not None:
                raise ApiError(400, "'thinking_token_budget' combines with a JSON response format or a forced tool "
                               "call, not with a regex, choice or grammar constraint", param="thinking_token_budget")
            params.thinking = None
            return constraint
        else:
            return None  # a budget alone: the verify worker ends the section at its position (thinking_end)
        close = lark_tag(CLOSE, tags)
        # with a budget the thinking is free text until </think>, which the verify worker forces at the budget
        lead, rules = (f"think {close}", "think: /(?s:.*)/\n") if budget else (close, "")
        return Constraint("lark", f"start: {lead} {body[0]}\n{rules}{body[1]}",
                          "tool_choice" if calls is not None else constraint.param)
    if calls is not None:
        return Constraint("lark", f"start: {calls[0]}\n{calls[1]}", "tool_choice")
    return constraint
