// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Verdict counters per reason and verdict events to the ring buffer, batched per CPU. */
#ifndef CILIATE_LIB_EVENTS_H
#define CILIATE_LIB_EVENTS_H

/* Not in older UAPI headers (Linux 6.7+). */
#ifndef BPF_F_TIMER_CPU_PIN
#define BPF_F_TIMER_CPU_PIN (1ULL << 1)
#endif
#ifndef CLOCK_MONOTONIC
#define CLOCK_MONOTONIC 1
#endif
#ifndef EBUSY
#define EBUSY 16
#endif

static __always_inline void count(__u32 reason)
{
	__u64 *c = bpf_map_lookup_elem(&verdict_counters, &reason);
	if (c)
		*c += 1;
}

static __always_inline void count_lost(__u32 n)
{
	__u32 reason = CILIATE_EVENTS_LOST;
	__u64 *c = bpf_map_lookup_elem(&verdict_counters, &reason);
	if (c)
		*c += n; /* the agent reports the loss, never silently */
}

/* `now`: CLOCK_MONOTONIC at tick resolution (the clock conntrack uses: a few ns, against ~50
 * for the precise clock's read in a VM). */
static __always_inline void fill_event(struct verdict_event *e, __u64 now, struct packet *p,
				       __u32 ep, __u32 identity, int egress, __u32 reason,
				       __u32 cookie)
{
	e->timestamp_ns = now;
	e->endpoint_id = ep;
	e->peer_identity = identity;
	e->egress = egress;
	e->protocol = p->protocol;
	e->port = p->policy_port;
	e->reason = reason;
	e->family = p->family;
	e->sport = p->sport;
	__builtin_memcpy(e->saddr, p->saddr, 16);
	__builtin_memcpy(e->daddr, p->daddr, 16);
	e->cookie = cookie;
	e->tcp_flags = p->tcp_flags;
	e->pad2[0] = 0;
	e->pad2[1] = 0;
	e->pad2[2] = 0;
}

static __always_inline void fill_event4(struct verdict_event4 *e, __u64 now, struct packet *p,
					__u32 ep, __u32 identity, int egress, __u32 reason,
					__u32 cookie)
{
	e->timestamp_ns = now;
	e->peer_identity = identity;
	e->cookie = cookie;
	e->egress = egress;
	e->protocol = p->protocol;
	e->port = p->policy_port;
	e->reason = reason;
	e->family = 4;
	e->endpoint_id = ep;
	__builtin_memcpy(e->saddr, p->saddr, 4);
	__builtin_memcpy(e->daddr, p->daddr, 4);
	e->sport = p->sport;
	e->tcp_flags = p->tcp_flags;
}

/* Sends the CPU's waiting events to the ring buffer as one record. */
static __noinline int flush_events(struct event_batch *b)
{
	__u32 n = b->used;
	if (n == 0)
		return 0;
	if (n > CILIATE_EVENT_BATCH_BYTES)
		n = CILIATE_EVENT_BATCH_BYTES;
	if (bpf_ringbuf_output(&events, b->buf, n, 0))
		count_lost(b->count);
	b->used = 0;
	b->count = 0;
	return 0;
}

static int flush_timer_fired(void *map, __u32 *key, struct event_batch *b)
{
	b->armed = 0;
	return flush_events(b);
}

/* Starts the CPU's flush timer for the events just put in its batch; when it cannot, the
 * batch leaves at once (no event waits without a timer). */
static __noinline void arm_flush(struct event_batch *b)
{
	if (!b->timer_ready) {
		long r = bpf_timer_init(&b->timer, &event_batches, CLOCK_MONOTONIC);
		if (r && r != -EBUSY) {
			flush_events(b);
			return;
		}
		b->timer_ready = 1;
	}
	/* Each time: a timer set up by an older program then calls this one's code. */
	if (bpf_timer_set_callback(&b->timer, flush_timer_fired) ||
	    bpf_timer_start(&b->timer, CILIATE_EVENT_FLUSH_NS, BPF_F_TIMER_CPU_PIN)) {
		flush_events(b);
		return;
	}
	b->armed = 1;
}

/* Puts one event in this CPU's batch, or in a record of its own for a CPU beyond the batch
 * array. One copy for every call site (a global function: verified once). */
__noinline int emit_event(struct packet *p, __u32 ep, __u32 identity, __u32 egress_reason,
			  __u32 cookie)
{
	if (!p)
		return 0;
	int egress = egress_reason >> 8;
	__u32 reason = egress_reason & 0xff;
	__u32 cpu = bpf_get_smp_processor_id();
	struct event_batch *b = bpf_map_lookup_elem(&event_batches, &cpu);
	if (b) {
		__u32 off = b->used;
		if (off > CILIATE_EVENT_BATCH_BYTES - sizeof(struct verdict_event)) {
			flush_events(b);
			off = 0;
		}
		if (off == 0) {
			*(__u64 *)b->buf = CILIATE_EVENT_RECORD_MARK;
			b->form = CILIATE_EVENT_FORM;
			b->first_ns = bpf_ktime_get_coarse_ns();
			off = 8;
		}
		off &= CILIATE_EVENT_BATCH_BYTES - 1;
		if (p->family == 4) {
			fill_event4((struct verdict_event4 *)(b->buf + off), b->first_ns, p, ep,
				    identity, egress, reason, cookie);
			off += sizeof(struct verdict_event4);
		} else {
			fill_event((struct verdict_event *)(b->buf + off), b->first_ns, p, ep,
				   identity, egress, reason, cookie);
			off += sizeof(struct verdict_event);
		}
		b->used = off;
		b->count += 1;
		if (off > CILIATE_EVENT_BATCH_BYTES - sizeof(struct verdict_event))
			flush_events(b);
		else if (!b->armed)
			arm_flush(b);
		return 0;
	}
	struct verdict_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost(1);
		return 0;
	}
	fill_event(e, bpf_ktime_get_coarse_ns(), p, ep, identity, egress, reason, cookie);
	bpf_ringbuf_submit(e, 0);
	return 0;
}

static __always_inline void emit(struct packet *p, __u32 ep, __u32 identity, int egress, __u32 reason,
				 __u32 cookie)
{
	int is_drop = (reason >= CILIATE_DROP_POLICY_DENY && reason <= CILIATE_DROP_MALFORMED) ||
		      reason == CILIATE_AUDIT_POLICY_DENY || reason == CILIATE_AUDIT_DEFAULT_DENY ||
		      reason == CILIATE_DROP_TUNNEL_NOT_A_PEER;
	if (!is_drop) {
		__u32 zero = 0;
		struct datapath_config *c = bpf_map_lookup_elem(&settings, &zero);
		if (!c || !c->emit_allow_events)
			return;
	}
	emit_event(p, ep, identity, ((__u32)(egress != 0) << 8) | (reason & 0xff), cookie);
}

#endif /* CILIATE_LIB_EVENTS_H */
