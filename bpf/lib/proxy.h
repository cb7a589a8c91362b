// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Transparent redirection of an endpoint's flows to a proxy (Cilium's proxy redirect): the
 * packet keeps its addresses, is assigned to the proxy's socket (bpf_sk_assign) and marked,
 * and the proxy's policy-routing rule (mark -> a table whose default route is local) delivers
 * it to that socket, which sees the peer the pod talks to as its destination. The DNS proxy
 * gets an endpoint's DNS (port 53) when its egress policy has DNS rules. */
#ifndef CILIATE_LIB_PROXY_H
#define CILIATE_LIB_PROXY_H

/* Is this the endpoint's DNS that the proxy must see? */
static __always_inline __u8 to_dns_proxy(struct endpoint_info *info, struct packet *p, int egress)
{
	return egress && (info->flags & CILIATE_EP_DNS_PROXY) && !p->l4_missing &&
	       (p->protocol == IPPROTO_UDP || p->protocol == IPPROTO_TCP) &&
	       p->dport == CILIATE_DNS_PORT;
}

/* Hands an allowed DNS packet to the proxy: TC_ACT_OK once assigned, TC_ACT_SHOT when no proxy
 * runs (the DNS rules cannot be enforced: fail closed). */
static __always_inline int dns_redirect(struct __sk_buff *skb, struct packet *p, __u32 ep)
{
	__u32 zero = 0;
	struct dns_proxy_config *c = bpf_map_lookup_elem(&dns_proxy, &zero);
	if (!c || !c->mark)
		goto down;
	skb->mark = c->mark;
	/* A TCP segment after the SYN: the proxy's accepted socket holds the tuple itself, and
	 * the stack's own lookup finds it once the mark routes the segment locally. */
	if (p->protocol == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN | TCP_ACK)) != TCP_SYN)
		return TC_ACT_OK;
	struct bpf_sock_tuple t = {};
	__u32 size;
	if (p->family == 4) {
		__builtin_memcpy(&t.ipv4.saddr, p->saddr, 4);
		__builtin_memcpy(&t.ipv4.daddr, p->daddr, 4);
		t.ipv4.sport = bpf_htons(p->sport);
		t.ipv4.dport = bpf_htons(p->protocol == IPPROTO_TCP ? c->tcp_port : c->udp_port);
		size = sizeof(t.ipv4);
	} else {
		__builtin_memcpy(t.ipv6.saddr, p->saddr, 16);
		__builtin_memcpy(t.ipv6.daddr, p->daddr, 16);
		t.ipv6.sport = bpf_htons(p->sport);
		t.ipv6.dport = bpf_htons(p->protocol == IPPROTO_TCP ? c->tcp_port : c->udp_port);
		size = sizeof(t.ipv6);
	}
	struct bpf_sock *sk;
	if (p->protocol == IPPROTO_TCP)
		sk = bpf_skc_lookup_tcp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		goto down;
	long err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	if (err)
		goto down;
	return TC_ACT_OK;
down:
	count(CILIATE_DROP_NOT_REALIZED);
	emit(p, ep, 0, 1, CILIATE_DROP_NOT_REALIZED, 0);
	return TC_ACT_SHOT;
}

#endif /* CILIATE_LIB_PROXY_H */
