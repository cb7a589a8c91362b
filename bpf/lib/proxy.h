// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Transparent redirection of an endpoint's flows to a proxy (Cilium's proxy redirect): the
 * packet keeps its addresses, is assigned to the proxy's socket (bpf_sk_assign) and marked,
 * and the proxy's policy-routing rule (mark -> a table whose default route is local) delivers
 * it to that socket, which sees the peer the pod talks to as its destination. The DNS proxy
 * gets an endpoint's DNS (port 53) when its egress policy has DNS rules; the HTTP proxy the
 * connections an allow entry with an L7 rule lets through (policy_value.proxy). */
#ifndef CILIATE_LIB_PROXY_H
#define CILIATE_LIB_PROXY_H

/* Is this the endpoint's DNS that the proxy must see? */
static __always_inline __u8 to_dns_proxy(struct endpoint_info *info, struct packet *p, int egress)
{
	return egress && (info->flags & CILIATE_EP_DNS_PROXY) && !p->l4_missing &&
	       (p->protocol == IPPROTO_UDP || p->protocol == IPPROTO_TCP) &&
	       p->dport == CILIATE_DNS_PORT;
}

/* Assigns a packet to the transparent socket listening on `port` (host byte order) for its
 * tuple. 0 when assigned. */
static __always_inline long assign_to(struct __sk_buff *skb, struct packet *p, __u16 port)
{
	struct bpf_sock_tuple t = {};
	__u32 size;
	if (p->family == 4) {
		__builtin_memcpy(&t.ipv4.saddr, p->saddr, 4);
		__builtin_memcpy(&t.ipv4.daddr, p->daddr, 4);
		t.ipv4.sport = bpf_htons(p->sport);
		t.ipv4.dport = bpf_htons(port);
		size = sizeof(t.ipv4);
	} else {
		__builtin_memcpy(t.ipv6.saddr, p->saddr, 16);
		__builtin_memcpy(t.ipv6.daddr, p->daddr, 16);
		t.ipv6.sport = bpf_htons(p->sport);
		t.ipv6.dport = bpf_htons(port);
		size = sizeof(t.ipv6);
	}
	struct bpf_sock *sk;
	if (p->protocol == IPPROTO_TCP)
		sk = bpf_skc_lookup_tcp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, size, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return -1;
	long err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	return err;
}

/* A TCP segment that opens a connection (SYN without ACK). */
static __always_inline int tcp_opening(struct packet *p)
{
	return p->protocol == IPPROTO_TCP && (p->tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
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
	if (p->protocol == IPPROTO_TCP && !tcp_opening(p))
		return TC_ACT_OK;
	if (assign_to(skb, p, p->protocol == IPPROTO_TCP ? c->tcp_port : c->udp_port))
		goto down;
	return TC_ACT_OK;
down:
	count(CILIATE_DROP_NOT_REALIZED);
	emit(p, ep, 0, 1, CILIATE_DROP_NOT_REALIZED, 0);
	return TC_ACT_SHOT;
}

/* The HTTP proxy (Cilium's L7 redirect). A connection whose allowing policy entry carries an
 * L7 rule goes to the proxy's transparent listener of its direction; every later packet of it
 * from the client, and every reply to a connection the proxy made on a client's behalf, is
 * marked so that policy routing delivers it to the proxy's socket on this host. At a tc
 * ingress hook (from_container, from_netdev) that is done in place; to_container, a tc egress
 * hook where no socket can be assigned, sends the packet back in through its own device
 * (l7_hairpin), and from_container hands it on. */
#define PROXY_NONE 0
#define PROXY_NEW 1   /* a new connection: assigned to the listener of its direction */
#define PROXY_LOCAL 2 /* a packet of a proxied connection: delivered to the proxy's socket */

/* What the host sends toward a pod, by its mark: the proxy's upstream connection made for an
 * egress-judged or an ingress-judged flow, or its answer to the client. */
#define UPSTREAM_NONE 0
#define UPSTREAM_EGRESS 1
#define UPSTREAM_INGRESS 2
#define FROM_DOWNSTREAM 3

static __always_inline struct l7_proxy_config *l7_config(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&l7_proxy, &zero);
}

/* Which of the proxy's sockets sent a packet (a mark pods cannot set: it does not cross into
 * the host's namespace). */
static __always_inline __u8 proxy_origin(__u32 mark)
{
	if (!mark)
		return UPSTREAM_NONE;
	struct l7_proxy_config *c = l7_config();
	if (!c || !c->local_mark)
		return UPSTREAM_NONE;
	if (mark == c->upstream_egress_mark)
		return UPSTREAM_EGRESS;
	if (mark == c->upstream_ingress_mark)
		return UPSTREAM_INGRESS;
	if (mark == c->downstream_mark)
		return FROM_DOWNSTREAM;
	return UPSTREAM_NONE;
}

/* At a tc ingress hook: a new connection to the listener of its direction (egress: the pod's
 * own), every packet marked for local delivery. TC_ACT_SHOT when no proxy runs. */
static __always_inline int l7_redirect(struct __sk_buff *skb, struct packet *p, __u32 ep,
				       __u8 action, int egress)
{
	struct l7_proxy_config *c = l7_config();
	if (!c || !c->local_mark)
		goto down;
	skb->mark = c->local_mark;
	if (action == PROXY_NEW && tcp_opening(p) &&
	    assign_to(skb, p, egress ? c->egress_port : c->ingress_port))
		goto down;
	return TC_ACT_OK;
down:
	count(CILIATE_DROP_NOT_REALIZED);
	emit(p, ep, 0, egress, CILIATE_DROP_NOT_REALIZED, 0);
	return TC_ACT_SHOT;
}

/* At to_container (the host veth's tc egress): back in through the same device's ingress,
 * marked, addressed to the device itself so the stack takes it; from_container sees the mark
 * (l7_hairpinned). */
static __always_inline int l7_hairpin(struct __sk_buff *skb, struct packet *p, __u32 ep)
{
	struct l7_proxy_config *c = l7_config();
	__u8 own[6];
	if (!c || !c->local_mark || bpf_skb_load_bytes(skb, 6, own, 6) < 0 ||
	    bpf_skb_store_bytes(skb, 0, own, 6, 0) < 0) {
		count(CILIATE_DROP_NOT_REALIZED);
		emit(p, ep, 0, 0, CILIATE_DROP_NOT_REALIZED, 0);
		return TC_ACT_SHOT;
	}
	skb->mark = c->local_mark;
	return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
}

/* from_container, for a packet to_container sent back in: already decided; a new connection
 * (to the pod's ingress) is assigned to the ingress listener. 1: it was one (*verdict set). */
static __always_inline int l7_hairpinned(struct __sk_buff *skb, __u32 ep, int *verdict)
{
	if (!skb->mark)
		return 0;
	struct l7_proxy_config *c = l7_config();
	if (!c || !c->local_mark || skb->mark != c->local_mark)
		return 0;
	struct packet p = {};
	*verdict = TC_ACT_OK;
	if (parse(skb, &p) == 0 && tcp_opening(&p) && assign_to(skb, &p, c->ingress_port)) {
		count(CILIATE_DROP_NOT_REALIZED);
		emit(&p, ep, 0, 0, CILIATE_DROP_NOT_REALIZED, 0);
		*verdict = TC_ACT_SHOT;
	}
	return 1;
}

#endif /* CILIATE_LIB_PROXY_H */
