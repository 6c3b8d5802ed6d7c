"""cffi declarations of native/wire/ and native/transport/, imported by
native/build_ffi.py. Constants are declared with `...` so their values come
from the C headers at build time: Python never holds a second copy of the
wire format. Struct layouts end in `...;` so cffi checks them against C."""

INCLUDES = '#include "wire.h"\n#include "wire_synth.h"\n#include "transport.h"\n#include "cover.h"\n#include "step.h"\n'

_CONSTANTS = """
WIRE_MAGIC WIRE_VERSION WIRE_ABI WIRE_HEADER_BYTES WIRE_MAC_BYTES WIRE_DIGEST_BYTES WIRE_KEY_MIN WIRE_KEY_MAX
WIRE_IP_UDP_BYTES WIRE_MTU_DEFAULT WIRE_MTU_MIN WIRE_MTU_MAX WIRE_MAX_DATAGRAM WIRE_MAX_MESSAGE
WIRE_MAX_FRAGMENTS WIRE_MAX_ERROR_TEXT WIRE_MAX_LAYERS WIRE_MAX_EXPERTS WIRE_MAX_TOKENS WIRE_TOKENS_DEFAULT WIRE_MAX_TOPK
WIRE_UPLOAD_PART_MAX WIRE_SYNTH_MAX_ENTRIES WIRE_F_MAC WIRE_F_REPLY WIRE_F_TWICE WIRE_R_ZERO WIRE_HELLO_DATA_MAC WIRE_HELLO_FAULTS
WIRE_HELLO_FULL WIRE_INVALIDATE_ALL WIRE_X_F32 WIRE_X_BF16 WIRE_DT_F32 WIRE_DT_BF16 WIRE_NONCE_BYTES WIRE_REPLAY_WINDOW WIRE_LINK_KEY_BYTES
WIRE_FWD_HOLD WIRE_HOLD_MAX WIRE_NACK_NO_RUN
DUCK_T_OK DUCK_T_ETIMEOUT DUCK_T_ETOOBIG DUCK_T_EARG DUCK_T_ESOCKET DUCK_T_EDUCK DUCK_T_ECOVER DUCK_T_ENORUN DUCK_ROUTE_HOST DUCK_ROUTE_NONE DUCK_STEP_ENOCUDA DUCK_STEP_ECUDA
DUCK_PIPELINE_DEFAULT DUCK_PIPELINE_MAX DUCK_NS_PER_TOKEN_UNKNOWN
""".split()

CDEF = "\n".join(f"#define {name} ..." for name in _CONSTANTS) + """
enum wire_type { WIRE_T_HELLO, WIRE_T_PING, WIRE_T_STATS, WIRE_T_CACHE_QUERY, WIRE_T_CACHE_INVALIDATE,
                 WIRE_T_UPLOAD, WIRE_T_SESSION_OPEN, WIRE_T_LAYER_PLAN, WIRE_T_SESSION_CLOSE, WIRE_T_FORWARD,
                 WIRE_T_SHUTDOWN, WIRE_T_RESEND, WIRE_T_NACK, WIRE_T_SYNTH, WIRE_T_RUN_OPEN, WIRE_T_COUNT, ... };
enum wire_status { WIRE_OK, WIRE_E_MALFORMED, WIRE_E_UNSUPPORTED, WIRE_E_NO_SESSION, WIRE_E_UNKNOWN_LAYER,
                   WIRE_E_UNKNOWN_DIGEST, WIRE_E_CACHE_FULL, WIRE_E_HASH_MISMATCH, WIRE_E_BAD_TENSOR,
                   WIRE_E_RANGE, WIRE_E_BUSY, WIRE_E_NOMEM, WIRE_E_IO, WIRE_E_STALE, ... };
enum wire_check_result { WIRE_CHECK_OK, WIRE_CHECK_SHORT, WIRE_CHECK_MAGIC, WIRE_CHECK_LENGTH,
                         WIRE_CHECK_FRAGMENT, WIRE_CHECK_CHECKSUM, WIRE_CHECK_MAC, WIRE_CHECK_TYPE,
                         WIRE_CHECK_LINK_MAC, WIRE_CHECK_NO_LINK, ... };
enum wire_mac_kind { WIRE_MAC_FLEET, WIRE_MAC_LINK, ... };
enum wire_mac_need { WIRE_MAC_NONE, WIRE_MAC_OPTIONAL, WIRE_MAC_REQUIRED, WIRE_MAC_DATA, ... };
typedef struct wire_type_info { const char *name; uint8_t mac_kind; uint8_t mac_need; uint32_t reply_size; } wire_type_info;

typedef struct wire_header {
    uint32_t magic; uint8_t version; uint8_t type; uint16_t flags; uint32_t session; uint32_t sequence;
    uint16_t frag_index; uint16_t frag_count; uint32_t payload_len; uint32_t total_len; uint32_t checksum; ...;
} wire_header;
typedef struct wire_reply_head { int32_t status; uint32_t flags; ...; } wire_reply_head;
typedef struct wire_hello_reply {
    uint32_t duck_id; uint32_t fw_version; uint32_t abi; uint16_t cores; uint16_t threads; uint64_t mem_bytes;
    uint64_t cache_bytes; uint64_t cache_capacity; uint32_t cache_entries; uint32_t session; uint32_t mtu;
    uint32_t flags; char name[...]; uint32_t max_tokens; uint32_t query_ms; uint8_t challenge[...]; uint8_t run[...];
    uint8_t query[...]; ...;
} wire_hello_reply;
typedef struct wire_query { uint8_t nonce[...]; ...; } wire_query;
typedef struct wire_ping { uint64_t t_ns; uint16_t reply_mtu; ...; } wire_ping;
typedef struct wire_stats {
    uint64_t datagrams_rx, datagrams_tx, requests, forwards, duplicates, resends, malformed, unauthenticated,
             stale, injected_drops, errors, bytes_streamed, kernel_ns, uploads_done, upload_bytes,
             cache_evictions, cache_corrupt, wake_ns, bad_mac, replayed, no_run, early_resends;
    ...;
} wire_stats;
typedef struct wire_invalidate { uint32_t flags; uint8_t digest[...]; ...; } wire_invalidate;
typedef struct wire_upload { uint8_t digest[...]; uint64_t total; uint64_t offset; uint32_t len; ...; } wire_upload;
typedef struct wire_upload_reply { uint64_t have; uint32_t complete; ...; } wire_upload_reply;
typedef struct wire_synth { uint32_t count; ...; } wire_synth;
typedef struct wire_synth_entry { fp9_synth_desc desc; uint8_t digest[...]; ...; } wire_synth_entry;
typedef struct wire_synth_reply { uint32_t created; uint32_t present; uint64_t bytes_created; ...; } wire_synth_reply;
typedef struct wire_session_open { uint32_t hidden; uint32_t flags; ...; } wire_session_open;
typedef struct wire_layer_plan { uint32_t layer; uint32_t n_experts; uint32_t hidden; ...; } wire_layer_plan;
typedef struct wire_forward {
    uint32_t layer; uint16_t ntok; uint8_t topk; uint8_t x_dtype; uint32_t hidden; uint8_t y_dtype;
    uint8_t flags; uint16_t reply_mtu; ...;
} wire_forward;
typedef struct wire_forward_reply {
    uint32_t layer; uint16_t ntok; uint8_t y_dtype; uint32_t hidden; uint32_t kernel_us; uint64_t bytes_streamed;
    uint32_t wake_ns; uint32_t group_ntok; ...;
} wire_forward_reply;
typedef struct wire_key { uint8_t bytes[...]; uint32_t len; uint32_t has_link; uint8_t run[...]; ...; } wire_key;
typedef struct wire_run_open { uint8_t run[...]; uint8_t challenge[...]; ...; } wire_run_open;
int wire_mac_kind(unsigned type);
int wire_mac_need(unsigned type);
extern const wire_type_info wire_types[];
void wire_link_set(wire_key *key, const uint8_t *run, const uint8_t *challenge);
void wire_poly1305(const uint8_t *key, const void *a, size_t alen, const void *b, size_t blen, uint8_t *out);
void wire_poly1305_ref(const uint8_t *key, const void *a, size_t alen, const void *b, size_t blen, uint8_t *out);
void wire_link_mac(const wire_key *key, const void *hdr, const void *payload, size_t len, uint8_t *out);

uint32_t wire_crc32c(uint32_t crc, const void *data, size_t len);
void wire_digest(const void *data, size_t len, uint8_t *out);
void wire_synth_digest(const fp9_synth_desc *d, uint8_t *out);
void wire_mac(const wire_key *key, const void *hdr, const void *payload, size_t len, uint8_t *out);
size_t wire_seal(const wire_header *h, const void *payload, uint32_t len, const wire_key *key, int with_mac,
                 uint8_t *out);
void wire_f32_to_bf16_n(const float *src, uint16_t *dst, size_t n);
int wire_check(const uint8_t *buf, size_t len, const wire_key *key, int require_mac, wire_header *h,
               const uint8_t **payload);
const char *wire_check_str(int result);
const char *wire_type_str(unsigned type);

typedef struct duck_transport_config {
    uint32_t n_ducks; const uint32_t *addrs; const uint16_t *ports; const uint8_t *key; uint32_t key_len;
    uint32_t mtu; uint32_t retransmit_us; uint32_t deadline_us; int32_t mac_data; uint32_t spin_us;
    uint32_t rcvbuf; uint32_t workers; int32_t twice; ...;
} duck_transport_config;
typedef struct duck_call {
    uint32_t duck; uint32_t type; uint32_t session; uint32_t payload_len; const void *payload; void *reply;
    uint32_t reply_cap; uint32_t reply_len; int32_t result; uint32_t retransmits; uint64_t rtt_ns;
    uint64_t work_ns; uint32_t local; ...;
} duck_call;
typedef struct duck_transport_stats {
    uint64_t calls, datagrams_tx, datagrams_rx, retransmits, resend_requests, nacks, timeouts, stale, malformed,
             unauthenticated, mtu_fallbacks, no_run, lost_hints, early_retransmits, twice_calls, twice_starts;
    int32_t last_errno; ...;
} duck_transport_stats;
typedef struct duck_transport duck_transport;
duck_transport *duck_transport_create(const duck_transport_config *cfg, char *err, uint32_t errlen);
void duck_transport_destroy(duck_transport *t);
uint32_t duck_transport_ducks(const duck_transport *t);
uint16_t duck_transport_local_port(const duck_transport *t);
int duck_transport_run(duck_transport *t, duck_call *calls, uint32_t n);
uint32_t duck_transport_agree(duck_transport *t, uint32_t duck, uint32_t duck_mtu);
uint32_t duck_transport_mtu(const duck_transport *t, uint32_t duck);
uint32_t duck_transport_path_mtu(const duck_transport *t, uint32_t duck);
uint32_t duck_transport_rcvbuf(const duck_transport *t);
unsigned duck_transport_workers(const duck_transport *t);
uint32_t duck_transport_rto_us(const duck_transport *t, uint32_t duck);
void duck_transport_run_nonce(const duck_transport *t, uint8_t *out);
int duck_transport_link(duck_transport *t, uint32_t duck, const uint8_t *challenge);
int duck_transport_linked(const duck_transport *t, uint32_t duck);
void duck_transport_unlink(duck_transport *t, uint32_t duck);
void duck_transport_key(const duck_transport *t, uint32_t duck, wire_key *out);
uint32_t duck_transport_take_sequence(duck_transport *t);
typedef struct duck_forward_args {
    uint32_t session, layer, ntok, topk, hidden; const int32_t *expert_ids; const float *expert_weights;
    const void *x; uint32_t x_dtype; uint32_t y_dtype; void *y; uint32_t request_tokens; uint32_t pipeline; uint32_t group_tokens;
    ...;
} duck_forward_args;
typedef struct duck_forward_result {
    int32_t failed_duck; int32_t result; int32_t duck_status; uint32_t kernel_us_max; uint64_t bytes_streamed;
    uint32_t retransmits; uint32_t wake_ns_max; uint32_t mtu_fallbacks; uint32_t requests; uint32_t request_tokens;
    uint32_t pipeline; uint32_t group; uint64_t kernel_us_sum; int32_t rcvbuf_short; uint32_t lost_new; uint64_t host_ns;
    uint32_t host_slices; uint32_t replica_slices; char message[...]; ...;
} duck_forward_result;
int duck_transport_forward(duck_transport *t, const duck_forward_args *a, duck_forward_result *res);
void duck_transport_plan(const duck_transport *t, const duck_forward_args *a, duck_forward_result *res);
void duck_transport_stats_get(const duck_transport *t, duck_transport_stats *out);

typedef uint32_t (*duck_cover_fn)(void *ctx, uint32_t slice, const duck_forward_args *a, uint32_t t0,
                                  uint32_t ntok, void *reply, uint32_t cap);
typedef struct duck_cover_config {
    duck_cover_fn forward; void *ctx; const uint64_t *slice_bytes; uint64_t budget_bytes; const int32_t *replica;
    uint32_t replica_layer_offset; uint32_t lost_calls; uint32_t lost_floor_us; ...;
} duck_cover_config;
int duck_transport_set_cover(duck_transport *t, const duck_cover_config *c, char *err, uint32_t errlen);
int duck_transport_set_lost(duck_transport *t, uint32_t duck, int lost, char *err, uint32_t errlen);
int duck_transport_lost(const duck_transport *t, uint32_t duck);
void duck_transport_hint_lost(duck_transport *t, uint32_t duck);
uint64_t duck_transport_progress(const duck_transport *t);
int32_t duck_transport_route(const duck_transport *t, uint32_t slice);
const char *duck_transport_cover_error(const duck_transport *t);
uint32_t duck_transport_lost_after_us(const duck_transport *t, uint32_t duck, uint32_t ntok);
typedef struct duck_cover duck_cover;
duck_cover *duck_cover_create(uint32_t n_slices, duck_pool *pool, const duck_kernels *kernels);
void duck_cover_destroy(duck_cover *c);
int duck_cover_set_layer(duck_cover *c, uint32_t slice, uint32_t layer, const duck_expert_slice *experts,
                         uint32_t n_experts);
void duck_cover_attach(duck_cover *c, duck_cover_config *cfg);

typedef struct duck_step {
    uint64_t stream; uint32_t n_segments; const uint64_t *graphs; const uint32_t *layers; const uint32_t *topks;
    duck_forward_args args; uint32_t spin_yield; int32_t *ids_log; uint32_t ids_log_stride; uint64_t *gpu_ns;
    uint64_t *ffn_ns; uint32_t *kernel_us; ...;
} duck_step;
typedef struct duck_step_result {
    int32_t failed_call; int32_t cuda_error; uint64_t kernel_us_sum; uint64_t bytes_streamed; uint32_t retransmits;
    uint32_t wake_ns_max; uint32_t mtu_fallbacks; uint32_t lost_new; uint64_t host_ns; uint32_t host_slices;
    duck_forward_result call; char message[...]; ...;
} duck_step_result;
int duck_step_cuda_available(char *err, uint32_t errlen);
int duck_step_run(duck_transport *t, const duck_step *s, duck_step_result *res);
"""

# The CPU host decoder's step over the fleet (host_step.h): it needs native/host/'s
# declarations, so native/build_ffi.py declares it after them.
HOST_STEP_INCLUDES = '#include "host_step.h"\n'
HOST_STEP_CDEF = """
#define DUCK_STEP_EHOST ...
typedef struct duck_host_step {
    duck_host_decoder *decoder; uint32_t n_layers; duck_forward_args args; uint32_t routed_topk;
    const int32_t *routed_ids; const float *routed_weights; const int32_t *dense_ids; const float *dense_weights;
    uint64_t *ffn_ns; uint32_t *kernel_us; ...;
} duck_host_step;
int duck_host_step_run(duck_transport *t, const duck_host_step *s, duck_step_result *res);
"""
