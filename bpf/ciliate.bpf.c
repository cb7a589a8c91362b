// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * ciliate's datapath: identity-based L3/L4 policy on an endpoint's host-side veth.
 *
 *   from_container: tc ingress of the host veth = traffic the pod sends  = the pod's egress
 *   to_container:   tc egress  of the host veth = traffic the pod receives = the pod's ingress
 *
 * Per packet: parse (Ethernet, IPv4 with fragments handled conservatively, IPv6 with extension
 * headers, TCP/UDP/SCTP/ICMP/ICMPv6), connection tracking (replies and established flows of
 * allowed connections pass), the peer's identity from the ipcache (longest prefix match), then
 * the endpoint's policy map with wildcard fallbacks (exact identity or any, exact protocol or
 * any, every port prefix length in use), deny winning over allow. Counters per entry and per
 * reason; verdict events to a ring buffer.
 *
 * Every map is pinned by name under <bpf-root>/ciliate/: each endpoint's program instance shares
 * them, and they outlive the agent, so enforcement goes on while it restarts.
 *
 * ENDPOINT_ID is a read-only global set before load (the modern form of Cilium's ELF
 * substitution): each endpoint gets its own program instance. 0 means "not an endpoint".
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "ciliate.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

const volatile __u32 ENDPOINT_ID = 0;

/* One header per concern; the order is the order of use. */
#include "lib/pinned.h"
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/ipcache.h"
#include "lib/policy.h"
#include "lib/events.h"
#include "lib/conntrack.h"
#include "lib/hostroute.h"
#include "lib/proxy.h"
#include "lib/hostfw.h"
#include "lib/tunnel.h"

/* Sends a packet of a connection the HTTP proxy handles on to the proxy: in place at a tc
 * ingress hook (the pod's egress, the node's device), back in through the device from
 * to_container. */
static __always_inline int to_l7_proxy(struct __sk_buff *skb, struct packet *p, __u32 ep,
				       __u8 action, int egress, int from_device)
{
	if (egress || from_device)
		return l7_redirect(skb, p, ep, action, egress);
	return l7_hairpin(skb, p, ep);
}

/* The endpoint's verdict on a packet (TC_ACT_OK or TC_ACT_SHOT; TC_ACT_REDIRECT when
 * to_container hands it to the HTTP proxy). from_device: the packet came to the node's device
 * and has not met the host stack (from_netdev); then TC_ACT_UNSPEC means "not this program's
 * to deliver". origin: which of the HTTP proxy's sockets sent it (to_container; proxy.h).
 * *bypass: the packet may skip the host stack (BPF host routing) because no netfilter NAT of
 * this node can be part of its connection. */
static __always_inline int decide(struct __sk_buff *skb, __u32 ep, int egress, int from_device,
				  __u8 origin, __u8 *bypass)
{
	*bypass = 0;
	if (ep == 0) {
		count(CILIATE_PASS_UNMANAGED);
		return TC_ACT_OK;
	}
	struct endpoint_info *info = bpf_map_lookup_elem(&endpoints, &ep);
	if (!info || !info->identity) {
		/* Attached but not (or no longer) known: fail closed. */
		count(CILIATE_DROP_NOT_REALIZED);
		return TC_ACT_SHOT;
	}
	struct packet p = {};
	int r = parse(skb, &p);
	if (r == 1) {
		count(CILIATE_PASS_NOT_IP);
		return TC_ACT_OK;
	}
	if (r < 0) {
		count(CILIATE_DROP_MALFORMED);
		emit(&p, ep, 0, egress, CILIATE_DROP_MALFORMED, 0);
		return TC_ACT_SHOT;
	}
	/* IPv6 link control, handled before policy as Cilium does: neighbour discovery (router and
	 * neighbour solicitation/advertisement, redirect: 133-137) and multicast listener
	 * messages (130-132, 143). Without them a pod has no IPv6 at all. */
	if (p.protocol == IPPROTO_ICMPV6_ && !p.l4_missing &&
	    ((p.policy_port >= 130 && p.policy_port <= 137) || p.policy_port == 143)) {
		count(CILIATE_PASS_NOT_IP);
		return TC_ACT_OK;
	}
	if (info->flags & CILIATE_EP_DROP_ALL) {
		count(CILIATE_DROP_NOT_REALIZED);
		emit(&p, ep, 0, egress, CILIATE_DROP_NOT_REALIZED, 0);
		return TC_ACT_SHOT;
	}

	/* Conntrack: the tuple as seen from the endpoint's side of this packet. */
	/* CLOCK_MONOTONIC at tick resolution: it reads the timekeeper's last tick instead of the
	 * clocksource (in a VM a paravirtual clock read), and a few milliseconds are nothing
	 * against conntrack timeouts of seconds. */
	__u64 now = bpf_ktime_get_coarse_ns();
	__u8 closing = p.protocol == IPPROTO_TCP && (p.tcp_flags & (TCP_FIN | TCP_RST));
	/* A TCP SYN without ACK opens a connection: it is never part of a tracked flow in either
	 * direction, so it skips both probes and always meets the policy in force (a retransmitted
	 * SYN too, and a simultaneous open); when allowed, its entry replaces any older one. */
	__u8 opening = p.protocol == IPPROTO_TCP && !p.l4_missing &&
		       (p.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	struct ct_value *ct = opening ? 0 : ct_lookup(&p, ep, 0);
	if (ct && ct->egress == egress) {
		ct->last_seen_ns = now;
		if (closing && !ct->closing)
			ct->closing = 1;
		__sync_fetch_and_add(&ct->packets, 1);
		count(CILIATE_ALLOW_ESTABLISHED);
		/* By the endpoint's DNS rules as they are now, not as when the flow began: a flow
		 * tracked before the endpoint got DNS rules goes to the proxy from now on (never
		 * around it), and one after they went goes straight to the server. */
		if (to_dns_proxy(info, &p, egress)) {
			ct->dns_proxy = 1;
			return dns_redirect(skb, &p, ep);
		}
		/* Redirected to the HTTP proxy where it opened: the client's packets keep going
		 * there (the client may be the proxy itself, judged at the pod's egress), but not
		 * those of the proxy's own connection judged at this ingress, on the same tuple. */
		if (ct->l7 && origin != UPSTREAM_INGRESS)
			return to_l7_proxy(skb, &p, ep, PROXY_LOCAL, egress, from_device);
		/* The opening direction: the pod's own packets, or what arrives for it as it did. */
		*bypass = 1;
		return TC_ACT_OK;
	}
	ct = opening ? 0 : ct_lookup(&p, ep, 1);
	if (ct && ct->egress != egress) {
		ct->last_seen_ns = now;
		if (!ct->replied)
			ct->replied = 1;
		if (closing && !ct->closing)
			ct->closing = 1;
		__sync_fetch_and_add(&ct->packets, 1);
		count(CILIATE_ALLOW_REPLY);
		/* A reply to a connection the HTTP proxy made goes to the proxy's socket. Only when
		 * a client's own proxied connection shares the tuple (ct->l7) do the proxy's
		 * answers to that client, told by their mark, go on to the pod. */
		if (ct->proxy_upstream && !(ct->l7 && origin == FROM_DOWNSTREAM))
			return to_l7_proxy(skb, &p, ep, PROXY_LOCAL, egress, from_device);
		/* A reply the pod sends skips the stack only if its connection did; a reply that
		 * arrives with the very tuple the pod sent to was translated by nobody. */
		*bypass = egress ? ct->direct : 1;
		return TC_ACT_OK;
	}
	/* At the node's device only a new TCP connection is judged: any other packet of no
	 * tracked flow may be the reply to a connection the stack translated on its way out
	 * (kube-proxy's DNAT of a LoadBalancer IP), which only the stack translates back. It
	 * takes the stack, and to_container judges it there. */
	if (from_device && !opening)
		return TC_ACT_UNSPEC;
	/* An ICMP error about a tracked connection belongs to it (Cilium's related traffic):
	 * path MTU discovery works under default deny. */
	if (p.protocol == IPPROTO_ICMP && ciliate_related_icmp4(skb, ep)) {
		count(CILIATE_ALLOW_REPLY);
		return TC_ACT_OK;
	}

	__u32 identity = peer_identity(&p, egress);
	__u32 cookie;
	__u8 redirect;
	__u32 reason = judge(ep, info, identity, egress, &p, skb->len, &cookie, &redirect);
	count(reason);
	emit(&p, ep, identity, egress, reason, cookie);
	if (dropped(reason))
		return TC_ACT_SHOT;
	/* Between a local pod and this node the host firewall judges the connection too (the
	 * HTTP proxy's own connections excepted: the pod's policy judged what they carry). */
	if (identity == CILIATE_ID_HOST && origin == UPSTREAM_NONE &&
	    host_drops(&p, info->identity, !egress, skb->len))
		return TC_ACT_SHOT;

	struct ct_value nv = {};
	nv.last_seen_ns = now;
	nv.packets = 1;
	nv.egress = egress;
	nv.closing = closing;
	nv.direct = from_device;
	nv.dns_proxy = to_dns_proxy(info, &p, egress);
	/* Allowed with an L7 rule: to the HTTP proxy, unless the proxy itself sends it after
	 * judging it at this endpoint's ingress. */
	__u8 send = redirect && origin != UPSTREAM_INGRESS && p.protocol == IPPROTO_TCP;
	nv.l7 = send;
	nv.proxy_upstream = origin == UPSTREAM_EGRESS || origin == UPSTREAM_INGRESS;
	if (nv.l7 || nv.proxy_upstream) {
		/* The proxy's connection and a client's may share a tuple: each keeps its part. */
		struct ct_value *old = ct_lookup(&p, ep, 0);
		if (old) {
			nv.l7 |= old->l7;
			nv.proxy_upstream |= old->proxy_upstream;
		}
	}
	*bypass = (egress || from_device) && !nv.dns_proxy && !nv.l7;
	if (ct_create(&p, ep, &nv))
		count(CILIATE_CT_FULL);
	if (nv.dns_proxy)
		return dns_redirect(skb, &p, ep);
	if (send)
		return to_l7_proxy(skb, &p, ep, PROXY_NEW, egress, from_device);
	return TC_ACT_OK;
}

SEC("tc")
int from_container(struct __sk_buff *skb)
{
	int verdict;
	/* Sent back in by to_container for the HTTP proxy: decided already. */
	if (l7_hairpinned(skb, ENDPOINT_ID, &verdict))
		return verdict;
	__u8 bypass;
	verdict = decide(skb, ENDPOINT_ID, 1, 0, UPSTREAM_NONE, &bypass);
	/* What the pod sends on (not what a proxy took: its mark routes it) is marked as the
	 * pod's, for the host firewall at the node's device. */
	if (verdict == TC_ACT_OK && !skb->mark)
		skb->mark = CILIATE_MARK_FROM_POD;
	if (verdict != TC_ACT_OK || !bypass)
		return verdict;
	return host_route(skb);
}

SEC("tc")
int to_container(struct __sk_buff *skb)
{
	__u8 bypass;
	return decide(skb, ENDPOINT_ID, 0, 0, proxy_origin(skb->mark), &bypass);
}

/* The node's device, tc ingress (one instance per agent, ENDPOINT_ID 0): packets for a local
 * pod meet its ingress policy here and are delivered into it (lib/hostroute.h); packets for
 * the node meet the host firewall (lib/hostfw.h). Everything else goes on (TC_ACT_UNSPEC: the
 * next TCX program, or the stack). */
SEC("tc")
int from_netdev(struct __sk_buff *skb)
{
	struct local_endpoint le;
	int tunnel = 0;
	if (skb->mark && ciliate_tunnel_decided(skb))
		return TC_ACT_UNSPEC;
	if (!local_endpoint_of(skb, &le)) {
		/* Tunnel mode: a tunnel packet for a local pod, decapsulated (lib/tunnel.h). */
		tunnel = tunnel_candidate(skb) ? ciliate_tunnel_decap4(skb, &le) : 0;
		if (!tunnel)
			return host_firewall(skb, 0);
		if (tunnel == TUNNEL_NOT_A_PEER)
			return ciliate_tunnel_reject(skb);
		if (tunnel < 0)
			return TC_ACT_SHOT;
	}
	__u8 bypass;
	int verdict = decide(skb, le.endpoint_id, 0, 1, UPSTREAM_NONE, &bypass);
	if (verdict == TC_ACT_OK && bypass)
		return local_deliver(skb, &le);
	/* Decapsulated, and the stack's to take (undecided, or for the HTTP proxy): into the
	 * tunnel device, as the kernel's decapsulation would have handed it on. */
	if (tunnel && (verdict == TC_ACT_UNSPEC || verdict == TC_ACT_OK))
		return bpf_redirect(tunnel, BPF_F_INGRESS);
	return verdict == TC_ACT_OK ? TC_ACT_UNSPEC : verdict;
}

/* The node's device, tc egress (attached with the host firewall): what the node itself sends
 * meets the host endpoint's egress policy (lib/hostfw.h). */
SEC("tc")
int to_netdev(struct __sk_buff *skb)
{
	return host_firewall(skb, 1);
}
