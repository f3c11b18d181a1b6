"""clawmux test support: LiteLLM's own spend records, written to a JSON-lines file.

LiteLLM keeps its spend logs in PostgreSQL through Prisma, and Prisma cannot be set up offline
(see tests/support/litellm.sh). This module is a LiteLLM `CustomLogger` callback, loaded by the
proxy from tests/support/litellm/config.yaml (`litellm_settings.callbacks`). For every LLM call
LiteLLM finishes, it appends one line to $CLAWMUX_LITELLM_SPEND_LOG with

  spend_log  the row LiteLLM's DB writer would insert into LiteLLM_SpendLogs: built by LiteLLM's
             own `get_logging_payload` (proxy/spend_tracking/spend_tracking_utils.py), the
             function `DBSpendUpdateWriter.update_database` calls, with `spend` = LiteLLM's
             response_cost, exactly as that writer sets it. Left out: messages, response and
             proxy_server_request (prompts and answers, not spend); the `metadata` JSON column
             is parsed into an object, minus `model_map_information` (the model's price table);
  standard   fields of LiteLLM's `standard_logging_object` (StandardLoggingPayload): end_user,
             metadata.spend_logs_metadata, metadata.requester_custom_headers, model, tokens,
             response_cost, litellm_call_id, trace_id, stream, status;
  event      "success" or "failure".

Nothing here decides attribution: every value is what LiteLLM computed. The proxy's master key
is not written: LiteLLM logs it as the placeholder `litellm_proxy_master_key` (a virtual key would
be hashed), and requester_custom_headers holds only `x-` headers, never Authorization.
"""
import datetime
import json
import os
import threading

from litellm.integrations.custom_logger import CustomLogger

_LOCK = threading.Lock()
_STANDARD_FIELDS = (
    "id", "trace_id", "litellm_call_id", "call_type", "stream", "status", "end_user", "model",
    "model_group", "api_base", "custom_llm_provider", "prompt_tokens", "completion_tokens",
    "total_tokens", "response_cost", "startTime", "endTime",
)
_METADATA_FIELDS = (
    "spend_logs_metadata", "requester_custom_headers", "user_api_key_hash", "user_api_key_alias",
    "user_api_key_end_user_id", "user_api_key_user_id", "user_api_key_team_id",
)


def _default(o):
    if isinstance(o, (datetime.datetime, datetime.date)):
        return o.isoformat()
    if hasattr(o, "model_dump"):
        return o.model_dump()
    return str(o)


class ClawmuxSpendLog(CustomLogger):
    def _write(self, event, kwargs, response_obj, start_time, end_time):
        path = os.environ.get("CLAWMUX_LITELLM_SPEND_LOG")
        if not path:
            return
        rec = {"event": event}
        slo = kwargs.get("standard_logging_object") or {}
        std = {k: slo.get(k) for k in _STANDARD_FIELDS}
        meta = slo.get("metadata") or {}
        std["metadata"] = {k: meta.get(k) for k in _METADATA_FIELDS}
        rec["standard"] = std
        try:
            from litellm.proxy.spend_tracking.spend_tracking_utils import get_logging_payload

            row = get_logging_payload(kwargs=kwargs, response_obj=response_obj, start_time=start_time, end_time=end_time)
            row = dict(row)
            row["spend"] = slo.get("response_cost") or 0.0  # as DBSpendUpdateWriter.update_database sets it
            for k in ("messages", "response", "proxy_server_request"):
                row.pop(k, None)  # prompts and answers: not spend
            meta = row.get("metadata")
            if isinstance(meta, str):  # the row's JSON column, parsed for readers of this file
                try:
                    meta = json.loads(meta)
                except ValueError:
                    pass
            if isinstance(meta, dict):
                meta.pop("model_map_information", None)  # the model's price table: not this call
            row["metadata"] = meta
            rec["spend_log"] = row
        except Exception as e:  # keep the record; say why the row is missing
            rec["spend_log_error"] = f"{type(e).__name__}: {e}"
        line = json.dumps(rec, default=_default, sort_keys=True) + "\n"
        with _LOCK:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._write("success", kwargs, response_obj, start_time, end_time)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self._write("failure", kwargs, response_obj, start_time, end_time)


handler = ClawmuxSpendLog()
