"""Prometheus metric names (base units, _total counters), shared so dashboards and tests agree."""

PREFIX = "dflash_"

# gateway
REQUESTS = PREFIX + "requests"  # counter, label outcome: success, error, rejected, aborted
PROMPT_TOKENS = PREFIX + "prompt_tokens"  # counter
GENERATION_TOKENS = PREFIX + "generation_tokens"  # counter
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"  # histogram
E2E_LATENCY = PREFIX + "e2e_request_latency_seconds"  # histogram
VERIFY_WORKER_UP = PREFIX + "verify_worker_up"  # gauge

# verify worker
SPEC_DRAFTS = PREFIX + "spec_drafts"  # counter: verify steps of a request that carried drafts
SPEC_DRAFT_TOKENS = PREFIX + "spec_draft_tokens"  # counter
SPEC_ACCEPTED_TOKENS = PREFIX + "spec_accepted_tokens"  # counter
SPEC_ACCEPTED_PER_POSITION = PREFIX + "spec_accepted_tokens_per_position"  # counter, label position
SPEC_DRAFTED_PER_POSITION = PREFIX + "spec_draft_tokens_per_position"  # counter, label position
STEP_SECONDS = PREFIX + "step_duration_seconds"  # histogram, label phase
RUNNING = PREFIX + "running_requests"  # gauge
WAITING = PREFIX + "waiting_requests"  # gauge
DRAFTER_AVAILABLE = PREFIX + "drafter_available"  # gauge, label kind
FALLBACK_STEPS = PREFIX + "spec_fallback_steps"  # counter: steps decoded without drafts for want of a drafter
POLICY_PLAIN_STEPS = PREFIX + "spec_policy_plain_steps"  # counter: steps --spec-policy adaptive decoded plainly
PREFIX_QUERY_TOKENS = PREFIX + "prefix_cache_query_tokens"  # counter: prompt tokens looked up in the prefix cache
PREFIX_HIT_TOKENS = PREFIX + "prefix_cache_hit_tokens"  # counter: prompt tokens found there (not prefilled)
PREFIX_CACHED_TOKENS = PREFIX + "prefix_cache_tokens"  # gauge: tokens kept for reuse (free slots', indexed pages')
KV_PAGES = PREFIX + "kv_cache_pages"  # gauge: a paged KV cache's pool
KV_PAGES_USED = PREFIX + "kv_cache_pages_used"  # gauge: pages running requests hold
PREEMPTIONS = PREFIX + "preemptions"  # counter: requests taken out of the batch for want of KV pages

# draft worker
DRAFT_CALLS = PREFIX + "draft_calls"  # counter
DRAFT_FORWARD = PREFIX + "draft_forward_seconds"  # histogram
DRAFT_CACHED_REQUESTS = PREFIX + "draft_cached_requests"  # gauge
DRAFT_RESYNCS = PREFIX + "draft_resyncs"  # counter
BAD_MESSAGES = PREFIX + "bad_messages"  # counter (every role), label role
