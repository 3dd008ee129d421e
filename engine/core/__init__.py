"""The step engine: requests, scheduler, KV block manager and the step loop."""
