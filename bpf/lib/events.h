// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Verdict counters per reason and verdict events to the ring buffer. */
#ifndef CILIATE_LIB_EVENTS_H
#define CILIATE_LIB_EVENTS_H

static __always_inline void count(__u32 reason)
{
	__u64 *c = bpf_map_lookup_elem(&verdict_counters, &reason);
	if (c)
		*c += 1;
}


static __always_inline void emit(struct packet *p, __u32 ep, __u32 identity, int egress, __u32 reason,
				 __u32 cookie)
{
	int is_drop = (reason >= CILIATE_DROP_POLICY_DENY && reason <= CILIATE_DROP_MALFORMED) ||
		      reason == CILIATE_AUDIT_POLICY_DENY || reason == CILIATE_AUDIT_DEFAULT_DENY;
	if (!is_drop) {
		__u32 zero = 0;
		struct datapath_config *c = bpf_map_lookup_elem(&settings, &zero);
		if (!c || !c->emit_allow_events)
			return;
	}
	struct verdict_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count(CILIATE_EVENTS_LOST); /* the agent reports the loss, never silently */
		return;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->timestamp_ns = bpf_ktime_get_ns();
	e->endpoint_id = ep;
	e->peer_identity = identity;
	e->egress = egress;
	e->protocol = p->protocol;
	e->port = p->policy_port;
	e->reason = reason;
	e->family = p->family;
	e->cookie = cookie;
	__builtin_memcpy(e->saddr, p->saddr, 16);
	__builtin_memcpy(e->daddr, p->daddr, 16);
	bpf_ringbuf_submit(e, 0);
}

#endif /* CILIATE_LIB_EVENTS_H */
