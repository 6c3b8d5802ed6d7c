/* The timing model of a duck's link: the retransmit timer and the expected
 * compute of a forward, from measured round trips and kernel times.
 *
 * The retransmit timer of a duck follows its measured round trips as TCP's
 * does (RFC 6298): srtt += (r - srtt) / 8, rttvar += (|r - srtt| - rttvar) / 4,
 * RTO = srtt + 4 rttvar, never below the configured retransmit_us (also the
 * value before any sample) nor above a quarter of the deadline. The samples
 * leave out the compute time a forward's reply reports, so that a long
 * prefill request does not slow the recovery of a lost decode datagram; a
 * call's own expected compute (duck_call.work_ns: for a forward, its tokens
 * times the duck's measured time per token plus 4 times its variation) is
 * added to its timer instead, and four times to its failure deadline: a duck
 * is not sent duplicates, nor declared dead, while it computes a large chunk;
 * a call queued behind others to the same duck expects theirs too. A call
 * that needed retransmits gives no sample (which transmission did the reply
 * answer?) but leaves the interval it completed in as the duck's floor until
 * a call completes without one (Karn); nor does a call that waited behind
 * another to the same duck. That floor is at most twice the measured timer
 * (srtt + 4 rttvar), so a run of lost datagrams on a lossy link does not leave
 * the timer doubled several times, nor does it compound from call to call;
 * a duck slower than its timer shows in its time per token (the compute
 * added to every timer), not in this floor.
 *
 * With a cover for lost ducks (transport_lost.c), a forward call's failure
 * deadline is not the configured constant but what the duck measurably
 * takes: lost_calls times its expected call (srtt + 4 rttvar + the call's
 * expected compute), at least lost_floor_us and at most the configured
 * deadline, and only once LOST_RETRANSMITS retransmits went unanswered too
 * (a lossy link). A slow duck's measurements grow with it (it is not
 * dropped); a dead one is caught within a few of its normal step times and its slices
 * are computed elsewhere, so an early verdict costs a little work, not the
 * request.
 *
 * The ducks of a tensor-parallel step do the same work and answer within a
 * short spread of each other. Once every other call of a run has its reply,
 * the last silent one is retransmitted after that spread (half its duck's
 * srtt, at least SIBLING_MIN_NS, plus a quarter of its expected compute) past
 * the latest reply instead of after its whole timer: on a lossy link most
 * steps lose a datagram somewhere, and each would otherwise cost a timer. A
 * duplicate that was not needed costs the duck an answer from its cache.
 *
 * Even so, each lost datagram of a decode step costs that spread and a round
 * trip, and at 5 % loss most steps lose one. So a link found lossy sends its
 * small forwards twice (WIRE_F_TWICE: each request datagram twice, and the
 * duck each datagram of its reply, flagged alike): a datagram is then lost
 * only when both copies are (0.25 % at 5 %). Retransmits do not say that a
 * link is lossy (on a loaded host most are a sibling's spread misjudged);
 * the copies do: of the reply datagrams a duck sent twice for a call that
 * needed no retransmit (a retransmit's answer is sent twice again), the
 * share that did not arrive is the link's loss; the second copy often
 * arrives after its call is done, so the last LINK_PROBES such calls of a
 * duck are remembered until then. While a link is not lossy, every
 * PROBE_EVERY-th small forward to it goes twice as a probe (its first
 * LOSS_COPIES / 2 all: a verdict soon after start); every
 * LOSS_COPIES reply copies due, a verdict: LOSSY_MISSING or more missing
 * (about 3 %) makes the link lossy; then CLEAN_MISSING or fewer of
 * CLEAN_COPIES (0.2 %) clean again (a lossy link's window is longer: at
 * 5 %, one of 128 copies with none missing is not rare). A
 * lossless link pays the copies of one small call in PROBE_EVERY; a prefill
 * chunk's hundreds of datagrams never go twice (RESEND asks for the missing
 * ones only). */
#define TWICE_MAX_FRAGS 4     /* a call of at most this many datagrams each way is small */
#define PROBE_EVERY 16
#define LOSS_COPIES 128
#define LOSSY_MISSING 4
#define CLEAN_COPIES 512
#define CLEAN_MISSING 1
#define _GNU_SOURCE   /* struct mmsghdr in transport_impl.h */
#include "transport_impl.h"

#include <string.h>

uint64_t tr_rto_ns(const duck_transport *t, uint32_t duck)
{
    const duck_link *l = &t->link[duck];
    uint64_t floor = (uint64_t)t->cfg.retransmit_us * 1000u, ceiling = (uint64_t)t->cfg.deadline_us * 250u;
    uint64_t rto = l->srtt_ns ? l->srtt_ns + 4 * l->rttvar_ns : 0;
    if (rto < l->backoff_ns)
        rto = l->backoff_ns;
    if (rto > ceiling)
        rto = ceiling;
    return rto > floor ? rto : floor;
}

#define SIBLING_MIN_NS 200000u

uint64_t tr_sibling_wait_ns(const duck_transport *t, const duck_call *c, const call_state *s)
{
    uint64_t half = t->link[c->duck].srtt_ns / 2;
    return (half > SIBLING_MIN_NS ? half : SIBLING_MIN_NS) + s->work_ns / 4;
}

uint32_t duck_transport_rto_us(const duck_transport *t, uint32_t duck)
{
    return duck < t->cfg.n_ducks ? (uint32_t)(tr_rto_ns(t, duck) / 1000u) : 0;
}

uint64_t tr_forward_kernel_ns(const duck_call *c)
{
    wire_reply_head head;
    wire_forward_reply fr;
    if (c->type != WIRE_T_FORWARD || c->reply_len < sizeof head + sizeof fr)
        return 0;
    memcpy(&head, c->reply, sizeof head);
    memcpy(&fr, (const uint8_t *)c->reply + sizeof head, sizeof fr);
    return head.status == WIRE_OK ? (uint64_t)fr.kernel_us * 1000u : 0;
}

/* The duck's time per token and its variation from a forward's reply,
 * smoothed as the round trip is (RFC 6298's gains). */
static void rate_sample(duck_link *l, const duck_call *c)
{
    wire_forward_reply fr;
    uint64_t kernel = tr_forward_kernel_ns(c);
    if (!kernel)
        return;
    memcpy(&fr, (const uint8_t *)c->reply + sizeof(wire_reply_head), sizeof fr);
    if (!fr.ntok)
        return;
    uint64_t per = kernel / (fr.group_ntok > fr.ntok ? fr.group_ntok : fr.ntok);   /* a pass over held requests */
    if (!l->ns_per_token) {
        l->ns_per_token = per;
        l->ns_per_token_var = per / 2;
        return;
    }
    uint64_t err = per > l->ns_per_token ? per - l->ns_per_token : l->ns_per_token - per;
    l->ns_per_token_var = (3 * l->ns_per_token_var + err) / 4;
    l->ns_per_token = (7 * l->ns_per_token + per) / 8;
}

uint64_t tr_work_ns(const duck_transport *t, uint32_t duck, uint32_t ntok)
{
    const duck_link *l = &t->link[duck];
    return (l->ns_per_token ? l->ns_per_token + 4 * l->ns_per_token_var : DUCK_NS_PER_TOKEN_UNKNOWN) * ntok;
}

void tr_rtt_sample(duck_link *l, const duck_call *c, const call_state *s, uint64_t now)
{
    rate_sample(l, c);
    if (c->retransmits) {
        /* at most twice the measured timer (srtt + 4 rttvar; before any sample, the one the call
         * started with): one lost datagram must not leave a timer that doubled through a run of
         * losses, nor may the floor compound call after call (the timer a call starts with holds
         * the last call's floor: on a 5 % lossy link most multi-fragment calls retransmit, and
         * "twice the start" walked the timer up to its ceiling, a quarter of the deadline, with
         * every lost datagram then waiting that long). A slow duck shows in its time per token,
         * not here. */
        uint64_t measured = l->srtt_ns ? l->srtt_ns + 4 * l->rttvar_ns : s->rto;
        l->backoff_ns = s->interval < 2 * measured ? s->interval : 2 * measured;
        return;
    }
    if (s->queued)
        return;
    uint64_t r = now - s->t_start, kernel = tr_forward_kernel_ns(c);
    r = r > kernel ? r - kernel : 0;
    if (!l->srtt_ns) {
        l->srtt_ns = r;
        l->rttvar_ns = r / 2;
    } else {
        uint64_t err = r > l->srtt_ns ? r - l->srtt_ns : l->srtt_ns - r;
        l->rttvar_ns = (3 * l->rttvar_ns + err) / 4;
        l->srtt_ns = (7 * l->srtt_ns + r) / 8;
    }
    l->backoff_ns = 0;
}

int tr_send_twice(duck_transport *t, const duck_call *c, const call_state *s)
{
    if (c->type != WIRE_T_FORWARD || s->req_frags > TWICE_MAX_FRAGS || t->cfg.twice < 0)
        return 0;
    wire_forward f;
    if (c->payload_len < sizeof f)
        return 0;
    memcpy(&f, c->payload, sizeof f);
    if (f.flags & WIRE_FWD_HOLD)
        return 0;   /* a part of a long forward (prefill): its copy would run the held pass early */
    duck_link *l = &t->link[c->duck];
    uint32_t k = l->small_calls++;
    return t->cfg.twice > 0 || l->lossy || k < LOSS_COPIES / 2 || k % PROBE_EVERY == 0;
}

enum { PROBE_FREE, PROBE_SENT, PROBE_CLEAN, PROBE_SPOILT };

/* A call's copies are counted: a verdict on the link every LOSS_COPIES of them. */
static void count_copies(duck_transport *t, duck_link *l, const twice_probe *p)
{
    if (p->state != PROBE_CLEAN)
        return;
    l->copies_due += 2u * p->frags;
    l->copies_seen += p->copies < 2u * p->frags ? p->copies : 2u * p->frags;
    if (l->copies_due < (l->lossy ? CLEAN_COPIES : LOSS_COPIES))
        return;
    uint32_t missing = l->copies_due - l->copies_seen;
    if (!l->lossy && missing >= LOSSY_MISSING && t->cfg.twice == 0) {
        l->lossy = 1;
        t->stats.twice_starts++;
    } else if (l->lossy && missing <= CLEAN_MISSING) {
        l->lossy = 0;
    }
    l->copies_due = l->copies_seen = 0;
}

static twice_probe *find_probe(duck_link *l, uint32_t seq)
{
    for (int i = 0; i < LINK_PROBES; i++)
        if (l->probes[i].state != PROBE_FREE && l->probes[i].seq == seq)
            return &l->probes[i];
    return NULL;
}

void tr_twice_sent(duck_transport *t, uint32_t duck, uint32_t seq)
{
    duck_link *l = &t->link[duck];
    twice_probe *p = &l->probes[l->probe_next++ % LINK_PROBES];
    count_copies(t, l, p);   /* the oldest: its copies have had a few calls' time */
    *p = (twice_probe){seq, 0, 0, PROBE_SENT};
}

void tr_twice_copy(duck_transport *t, uint32_t duck, uint32_t seq)
{
    twice_probe *p = find_probe(&t->link[duck], seq);
    if (p && p->copies < UINT8_MAX)
        p->copies++;
}

void tr_loss_sample(duck_transport *t, const duck_call *c, const call_state *s)
{
    twice_probe *p = s->twice ? find_probe(&t->link[c->duck], s->seq) : NULL;
    if (p && p->state == PROBE_SENT) {
        p->state = c->retransmits || s->rep_count > TWICE_MAX_FRAGS ? PROBE_SPOILT : PROBE_CLEAN;
        p->frags = (uint16_t)s->rep_count;
    }
}

void tr_start_timer(const duck_transport *t, const duck_call *c, call_state *s, uint64_t now)
{
    uint64_t rto = tr_rto_ns(t, c->duck), half = (uint64_t)t->cfg.deadline_us * 500u;
    s->rto = rto;
    s->interval = rto + s->work_ns;
    s->cap = 8 * rto < half ? 8 * rto : half;
    if (s->cap < s->interval)
        s->cap = s->interval;
    s->hard_ns = (uint64_t)t->cfg.deadline_us * 1000u + 4 * s->work_ns;
    s->deadline_ns = c->type == WIRE_T_FORWARD ? tr_lost_ns(t, c->duck, s->work_ns) : s->hard_ns;
    s->t_next = now + s->interval;
}

uint64_t tr_fail_at(const duck_call *c, const call_state *s)
{
    int tried = s->deadline_ns >= s->hard_ns || c->retransmits >= LOST_RETRANSMITS;
    return s->t_heard + (tried ? s->deadline_ns : s->hard_ns);
}

uint64_t tr_lost_ns(const duck_transport *t, uint32_t duck, uint64_t work_ns)
{
    const duck_link *l = &t->link[duck];
    uint64_t deadline = (uint64_t)t->cfg.deadline_us * 1000u + 4 * work_ns;
    if (!t->cover.forward || !t->cover.lost_calls || !l->srtt_ns || !l->ns_per_token)
        return deadline;   /* nothing measured yet: the configured deadline */
    uint64_t lost = (l->srtt_ns + 4 * l->rttvar_ns + work_ns) * t->cover.lost_calls;
    uint64_t floor = (uint64_t)t->cover.lost_floor_us * 1000u;
    lost = lost > floor ? lost : floor;
    return lost < deadline ? lost : deadline;
}

uint32_t duck_transport_lost_after_us(const duck_transport *t, uint32_t duck, uint32_t ntok)
{
    return duck < t->cfg.n_ducks ? (uint32_t)(tr_lost_ns(t, duck, tr_work_ns(t, duck, ntok)) / 1000u) : 0;
}
