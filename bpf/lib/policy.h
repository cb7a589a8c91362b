// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The endpoint's policy map: wildcard fallbacks (identity or any, protocol or any, each port
 * prefix length in use), deny winning over allow, counters per entry. */
#ifndef CILIATE_LIB_POLICY_H
#define CILIATE_LIB_POLICY_H

#define POLICY_NONE 0
#define POLICY_ALLOW 1
#define POLICY_DENY 2

/* Probes one policy entry; returns POLICY_DENY (and counts it, its cookie in *cookie) on a
 * deny, remembers an allow (and whether any allow sends the flow to the HTTP proxy). */
static __always_inline int probe(void *pmap, struct policy_key *k, struct policy_value **allow,
				 __u64 bytes, __u32 *cookie, __u8 *proxy)
{
	struct policy_value *v = bpf_map_lookup_elem(pmap, k);
	if (!v)
		return POLICY_NONE;
	if (v->deny) {
		__sync_fetch_and_add(&v->packets, 1);
		__sync_fetch_and_add(&v->bytes, bytes);
		*cookie = v->cookie;
		return POLICY_DENY;
	}
	if (!*allow)
		*allow = v;
	*proxy |= v->proxy;
	return POLICY_ALLOW;
}

/* The number of set bits, without branches (BPF has no popcount instruction). */
static __always_inline __u32 popcount32(__u32 x)
{
	x = x - ((x >> 1) & 0x55555555);
	x = (x & 0x33333333) + ((x >> 2) & 0x33333333);
	x = (x + (x >> 4)) & 0x0f0f0f0f;
	return (x * 0x01010101) >> 24;
}

/* Deny-wins lookup: every entry that could match is probed (only the kinds the endpoint's
 * masks say exist); the first deny decides, else any allow. *cookie: the deciding entry's;
 * *proxy: an allow with an L7 rule matched (the flow goes to the HTTP proxy). */
static __always_inline int policy_lookup(void *pmap, __u32 identity, __u8 egress, struct packet *p,
					 struct endpoint_info *info, __u64 bytes, __u32 *cookie,
					 __u8 *proxy)
{
	struct policy_value *allow = 0;
	struct policy_key k = {};
	__u32 lens_id = info->port_prefix_lens, lens_any = info->any_identity_lens;
	if (!(info->flags & CILIATE_EP_SPLIT_LENS)) {
		lens_id |= CILIATE_LENS_ALL_PROTOCOLS;
		lens_any = lens_id;
	}
	k.egress = egress;

#pragma unroll
	for (int i = 0; i < 2; i++) {
		__u32 lens = i == 0 ? lens_id : lens_any;
		k.identity = i == 0 ? identity : 0;
		if (i == 1 && identity == 0)
			break;
		if (!lens)
			continue;
		if (lens & CILIATE_LENS_ALL_PROTOCOLS) {
			k.protocol = 0;
			k.port = 0;
			k.port_prefix_len = 0;
			if (probe(pmap, &k, &allow, bytes, cookie, proxy) == POLICY_DENY)
				return POLICY_DENY;
		}
		k.protocol = p->protocol;
		if (lens & 1) {
			k.port = 0;
			k.port_prefix_len = 0;
			if (probe(pmap, &k, &allow, bytes, cookie, proxy) == POLICY_DENY)
				return POLICY_DENY;
		}
		if (p->l4_missing)
			continue;
		/* One pass per port prefix length in use (a set bit), shortest first, not one
		 * per possible length: most endpoints use one or two. */
		__u32 ports = lens & 0x1fffe;
		for (int j = 0; j < 16 && ports; j++) {
			__u32 low = ports & -ports;
			ports ^= low;
			__u32 len = popcount32(low - 1);
			__u16 mask = (__u16)(0xffff0000u >> len);
			k.port = p->policy_port & mask;
			k.port_prefix_len = len;
			if (probe(pmap, &k, &allow, bytes, cookie, proxy) == POLICY_DENY)
				return POLICY_DENY;
		}
	}
	if (allow) {
		__sync_fetch_and_add(&allow->packets, 1);
		__sync_fetch_and_add(&allow->bytes, bytes);
		*cookie = allow->cookie;
		return POLICY_ALLOW;
	}
	return POLICY_NONE;
}

/* Endpoint `ep`'s verdict (a ciliate_reason) on a new connection with a peer of `identity`:
 * the deny-wins lookup, then default deny where the endpoint is isolated, audit mode turning
 * drops into audits. *cookie: what attributes the verdict; *redirect: an L7 rule covers it. */
static __always_inline __u32 judge(__u32 ep, struct endpoint_info *info, __u32 identity, int egress,
				   struct packet *p, __u64 len, __u32 *cookie, __u8 *redirect)
{
	void *pmap = bpf_map_lookup_elem(&policy_maps, &ep);
	int verdict = POLICY_NONE;
	__u32 reason;
	*cookie = 0;
	*redirect = 0;
	if (pmap)
		verdict = policy_lookup(pmap, identity, egress, p, info, len, cookie, redirect);
	if (verdict == POLICY_DENY) {
		reason = CILIATE_DROP_POLICY_DENY;
	} else if (verdict == POLICY_ALLOW) {
		reason = CILIATE_ALLOW_POLICY;
	} else {
		__u32 isolated = egress ? (info->flags & CILIATE_EP_EGRESS_DEFAULT_DENY)
					: (info->flags & CILIATE_EP_INGRESS_DEFAULT_DENY);
		reason = isolated ? CILIATE_DROP_DEFAULT_DENY : CILIATE_ALLOW_NOT_ISOLATED;
		*cookie = isolated ? (egress ? info->egress_cookie : info->ingress_cookie) : 0;
	}
	if (info->flags & CILIATE_EP_AUDIT) {
		/* Audit: the would-be drop passes (and is tracked like any allowed connection). */
		if (reason == CILIATE_DROP_POLICY_DENY)
			reason = CILIATE_AUDIT_POLICY_DENY;
		else if (reason == CILIATE_DROP_DEFAULT_DENY)
			reason = CILIATE_AUDIT_DEFAULT_DENY;
	}
	return reason;
}

static __always_inline int dropped(__u32 reason)
{
	return reason == CILIATE_DROP_POLICY_DENY || reason == CILIATE_DROP_DEFAULT_DENY;
}

#endif /* CILIATE_LIB_POLICY_H */
