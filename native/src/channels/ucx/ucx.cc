// UCX as a net (net.h): channels over UCP tag send / receive. UCX picks its own transports
// (shared memory and CMA on one host, TCP, InfiniBand / RoCE where present; UCX_TLS
// chooses). libucp is loaded at run time (dlopen) from the library the Python side names
// (the libucx wheel's), so the engine builds with UCX's headers alone and imports, and runs
// every other transport, on machines without UCX. Any UCX 1.x from the floor on will do
// (ucx_library.h): the version the headers of the build happen to have does not matter.
//
// Per communicator: one UCP context and two workers, one per stream (collectives, send /
// recv), each used by one thread at a time as the engine drives its streams. A channel is
// an endpoint to the peer's worker of the same stream. Messages carry tags
// (sender rank << 32 | part): part 0 is the 40-byte WireHeader, with the payload behind it
// in the same message up to kInlineBytes; a larger payload follows as a message of part 1,
// received straight into place once its header has been checked. So no payload byte lands
// in a user buffer before its header was accepted, as on every channel. Across hosts a
// collective channel has several endpoints to its peer (COMM_SOCKETS_PER_PEER, as TCP's
// sockets: each its own connection over TCP), and a payload from kStripeMinBytes is cut
// into stripes, stripe i a message of part kPayloadPart (i = 0) or kStripePart + i - 1 on
// endpoint i: one connection's flow leaves the link half used, as the TCP channel measured.
//
// On one host a large payload is instead read by the receiver straight out of the sender's
// buffer (process_vm_readv, one copy, as Open MPI does) and acknowledged with a part-2
// message: UCX's own CMA transport stays off there (see UcxNet), so UCX alone would copy
// twice through its shared-memory queue. A receiver that may not read the sender (ptrace
// rules, another pid namespace) answers so, and the payload then travels through UCX.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "channels/net.h"
#include "channels/ucx/ucx_library.h"
#include "windows/window_ucx.h"

namespace comm {

// A UCX failure as the engine's error: truncation means the ranks disagree on a size,
// a timeout is a timeout, anything else broke the connection to `peer`.
void fail_status(const Ucp& u, ucs_status_t st, int peer, const char* what) {
  const std::string them = "rank " + std::to_string(peer);
  if (st == UCS_ERR_MESSAGE_TRUNCATED)
    fail(ErrorCode::MISMATCH, peer,
         "a message from " + them + " is larger than the receive posted for it (ranks called "
         "the operation with different sizes)");
  const std::string msg = std::string("UCX ") + what + " with " + them + " failed: " + u.ucs_status_string(st);
  if (st == UCS_ERR_TIMED_OUT || st == UCS_ERR_ENDPOINT_TIMEOUT)
    fail(ErrorCode::TIMEOUT, peer, msg + " (the peer is hung or unreachable)");
  if (st == UCS_ERR_CANCELED) fail(ErrorCode::ABORTED, peer, msg);
  fail(ErrorCode::PEER_FAILURE, peer, msg + ": the peer process died or closed its communicator");
}

namespace {

constexpr size_t kHeader = sizeof(WireHeader);
// Payloads up to this size travel in their header's message (one message per transfer;
// copied once more on arrival, which costs less than a second message below it).
constexpr size_t kInlineBytes = 8 << 10;
constexpr uint64_t kHeaderPart = 0, kPayloadPart = 1, kAckPart = 2, kStripePart = 3;
// Same-host payloads from this size on are read by the receiver (one copy instead of two);
// the read goes in slices so that other transfers of the operation move in between.
constexpr size_t kReadMinBytes = 64 << 10, kReadSliceBytes = 1 << 20;
constexpr char kReadOk = 'k', kReadRefused = 'n';

// Behind the header of a payload that the receiver reads itself: where it lies, and a word
// whose value the receiver checks once before trusting the pid (pids of another namespace).
struct ReadOffer {
  uint64_t pid, addr, cookie_addr, cookie;
};
// A drained payload (all_to_all splits that disagree) is received into memory; one larger
// than this fails the exchange at once instead (its length is the peer's word).
constexpr size_t kMaxDrainBytes = size_t{256} << 20;
// A clean close flushes each endpoint; a peer that stopped progressing cannot hold us longer.
constexpr auto kCloseWait = std::chrono::milliseconds(500);

struct Worker {
  ucp_worker_h h = nullptr;
  std::vector<int> efd;  // one descriptor: the worker's events (sockets() of its channels)
  std::string address;
};

class UcxChannel final : public Channel {
 public:
  // rma: the net's RMA windows, told of this endpoint (p2p channels only; else null).
  UcxChannel(const Ucp& u, Worker& w, int peer, int rank, const std::string& remote, bool same_host,
             int stripes, std::shared_ptr<UcxRmaHub> rma);
  ~UcxChannel() override;
  // True when UCX itself moved anything, not only when `t` advanced: a message can take many
  // progress calls to drain from UCX's shared-memory queue (a bounded number of fragments per
  // call), and the engine reads "nothing moved" after a peer's goodbye as "nothing will".
  bool progress(Transfer& t) override {
    const bool worked = u_.ucp_worker_progress(w_.h) != 0;
    if (ep_status_ != UCS_OK) fail_status(u_, ep_status_, peer_, "connection");
    return (t.is_send ? progress_send(t) : progress_recv(t)) || worked;
  }
  bool ready(const Transfer& t) const override {
    return (!t.is_send && recv_ == Recv::READ) || u_.ucp_worker_arm(w_.h) != UCS_OK;
  }
  const std::vector<int>& sockets() const override { return w_.efd; }
  short poll_events(bool) const override { return POLLIN; }
  bool polled() const override { return true; }  // UCX's shared memory moves without a syscall
  void abandon(Transfer& t) override;
  bool flushed_before_goodbye() const override { return true; }  // see Engine::close
  void peer_left() override { peer_left_ = true; }
  void forget() { forgotten_ = true; }

 private:
  enum class Recv { IDLE, HEADER, PAYLOAD, READ };
  void* post_send(const void* buf, size_t len, uint64_t part, size_t ep = 0);
  void* post_recv(void* buf, size_t len, uint64_t part, ucp_tag_recv_info_t* info);
  // Whether request `r` is finished (then freed and set null); throws its failure. A
  // receive's length is then in `info` (the one it was posted with).
  bool finished(void*& r, ucp_tag_recv_info_t* info = nullptr);
  void close_endpoint(ucp_ep_h ep, bool force);  // flushes unless forced, for kCloseWait at most
  // A payload of `len` bytes as stripes (see the top): sent from, or received into, `buf`.
  int stripes(size_t len) const { return len >= kStripeMinBytes ? static_cast<int>(eps_.size()) : 1; }
  void send_payload(const char* buf, size_t len);
  void recv_payload(char* buf, size_t len);
  bool payload_arrived(size_t len);
  bool progress_send(Transfer& t);
  bool progress_recv(Transfer& t);
  void header_arrived(Transfer& t, size_t length);
  bool read_offered(Transfer& t);  // Recv::READ: read a slice of the sender's buffer
  void answer_offer(char answer);
  void offer_refused(Transfer& t);
  [[noreturn]] void corrupt() const {
    fail(ErrorCode::MISMATCH, peer_, "corrupt message from rank " + std::to_string(peer_) + " over UCX");
  }
  static void on_error(void* self, ucp_ep_h, ucs_status_t st) {
    static_cast<UcxChannel*>(self)->ep_status_ = st;
  }

  const Ucp& u_;
  Worker& w_;
  std::shared_ptr<UcxRmaHub> rma_;
  const uint64_t my_tag_, peer_tag_;
  const bool peer_errors_;  // UCX reports this peer's failure (off on one host: see connect)
  std::vector<ucp_ep_h> eps_;  // to the peer's worker; more than one across hosts (COLL)
  ucs_status_t ep_status_ = UCS_OK;
  bool broken_ = false;     // a transfer was abandoned: no clean close
  bool peer_left_ = false;  // the peer closed first: nothing to flush towards it
  bool forgotten_ = false;  // a forked child's copy: touch nothing
  // In flight: at most one send (header + payload) and one receive (Channel's contract).
  const Transfer* send_of_ = nullptr;
  std::vector<void*> send_req_;  // the header's message, then the payload's stripes
  std::vector<char> send_bounce_;
  // Same-host reads (see the top): `reads_` until the peer refused one. A send offered for
  // reading waits for the answer in `answer_in_`; a receive answers from `answer_out_`.
  bool reads_;
  // The receiver reads it back before its first read (the pid is its peer's) and after each
  // payload; a send abandoned while offered changes it, so a read that may have raced the
  // caller's next write to the buffer is caught instead of delivered.
  std::atomic<uint64_t> cookie_;
  bool peer_checked_ = false;  // the first offer's cookie was read back from the peer
  void* answer_req_ = nullptr;
  ucp_tag_recv_info_t answer_info_{};
  char answer_in_ = 0, answer_out_ = 0;
  void* answer_out_req_ = nullptr;
  bool send_offered_ = false;
  ReadOffer offer_{};
  uint64_t offered_len_ = 0;
  const Transfer* recv_of_ = nullptr;
  Recv recv_ = Recv::IDLE;
  void* recv_req_ = nullptr;           // the header's message
  ucp_tag_recv_info_t recv_info_{};
  std::vector<void*> payload_req_;    // the payload's stripes
  std::vector<ucp_tag_recv_info_t> payload_info_;
  std::vector<char> recv_bounce_;
  // A header-only receive (P2P reads the header, then posts the body separately) leaves the
  // message's payload behind: inline in `stash_`, as the part-1 message still to come, or
  // offered for reading (`offer_`).
  bool stashed_ = false, payload_follows_ = false, offer_follows_ = false;
  std::vector<char> stash_;
  std::vector<char> drain_;  // where a drained payload goes
};

UcxChannel::UcxChannel(const Ucp& u, Worker& w, int peer, int rank, const std::string& remote,
                       bool same_host, int stripes, std::shared_ptr<UcxRmaHub> rma)
    : Channel(peer), u_(u), w_(w), rma_(std::move(rma)), my_tag_(uint64_t(rank) << 32), peer_tag_(uint64_t(peer) << 32),
      peer_errors_(!same_host), send_req_(1 + stripes, nullptr), send_bounce_(kHeader + kInlineBytes),
      reads_(same_host),
      cookie_(reinterpret_cast<uint64_t>(this) ^ (uint64_t(getpid()) << 40) ^ 0x5eedc0de5eedc0deULL),
      payload_req_(stripes, nullptr), payload_info_(stripes), recv_bounce_(kHeader + kInlineBytes) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = reinterpret_cast<const ucp_address_t*>(remote.data());
  // UCX's peer-failure handling rules out its shared-memory transports, so it is on across
  // hosts only; on one host the engine's monitor sockets report a dead peer.
  p.err_mode = peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer_errors_) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_handler.cb = &UcxChannel::on_error;
    p.err_handler.arg = this;
  }
  for (int i = 0; i < stripes; i++) {
    ucp_ep_h ep = nullptr;
    const ucs_status_t st = u_.ucp_ep_create(w_.h, &p, &ep);
    if (st != UCS_OK) {
      // The constructor throws, so no destructor runs: the endpoints made so far close here
      // (forced: more than one is made across hosts only, where error handling allows it).
      for (ucp_ep_h made : eps_) close_endpoint(made, true);
      fail_status(u_, st, peer, "connect");
    }
    eps_.push_back(ep);
  }
  if (rma_) rma_->endpoint(peer, eps_[0]);
}

UcxChannel::~UcxChannel() {
  if (forgotten_) return;
  if (rma_) rma_->endpoint_closing(peer_);  // rkeys unpacked on the endpoint go before it
  // UCX completes a freed request internally (the worker's destruction at last).
  std::vector<void*> receives{recv_req_, answer_req_}, sends{answer_out_req_};
  receives.insert(receives.end(), payload_req_.begin(), payload_req_.end());
  sends.insert(sends.end(), send_req_.begin(), send_req_.end());
  for (void* r : receives)
    if (r) u_.ucp_request_cancel(w_.h, r), u_.ucp_request_free(r);
  for (void* r : sends)
    if (r) u_.ucp_request_free(r);
  // A clean close flushes what is in flight. After a failure, or once the peer has closed,
  // force it: the peer's operations already failed or ended, and a flush into its closed
  // connection would only fail (UCX logs each such failure as an error).
  const bool gone = broken_ || peer_left_;
  if (gone && !peer_errors_) return;  // forcing needs error handling: the worker's end closes it
  for (ucp_ep_h ep : eps_) close_endpoint(ep, gone);
}

void UcxChannel::close_endpoint(ucp_ep_h ep, bool force) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* r = u_.ucp_ep_close_nbx(ep, &p);
  if (!UCS_PTR_IS_PTR(r)) return;
  const auto until = Clock::now() + kCloseWait;
  while (u_.ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until)
    u_.ucp_worker_progress(w_.h);
  u_.ucp_request_free(r);
}

void* UcxChannel::post_send(const void* buf, size_t len, uint64_t part, size_t ep) {
  ucp_request_param_t p{};
  void* r = u_.ucp_tag_send_nbx(eps_[ep], buf, len, my_tag_ | part, &p);
  if (UCS_PTR_IS_ERR(r)) fail_status(u_, UCS_PTR_STATUS(r), peer_, "send");
  return r;  // null: completed at once
}

void* UcxChannel::post_recv(void* buf, size_t len, uint64_t part, ucp_tag_recv_info_t* info) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
  // Before 1.16 a receive that completes at once leaves `info` as it was (openucx/ucx#9425),
  // and a length of 0 reads as a corrupt message: there every receive returns a request.
  if (u_.minor < kUcxImmediateInfoMinor) p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.recv_info.tag_info = info;
  *info = {};
  void* r = u_.ucp_tag_recv_nbx(w_.h, buf, len, peer_tag_ | part, ~uint64_t{0}, &p);
  if (UCS_PTR_IS_ERR(r)) fail_status(u_, UCS_PTR_STATUS(r), peer_, "receive");
  return r;  // null: completed at once, and `info` says how long it was
}

bool UcxChannel::finished(void*& r, ucp_tag_recv_info_t* info) {
  if (!r) return true;
  const ucs_status_t st = info ? u_.ucp_tag_recv_request_test(r, info) : u_.ucp_request_check_status(r);
  if (st == UCS_INPROGRESS) return false;
  u_.ucp_request_free(r);
  r = nullptr;
  if (st != UCS_OK) fail_status(u_, st, peer_, info ? "receive" : "send");
  return true;
}

// Stripe i of a payload of `len` bytes is [i*len/k, (i+1)*len/k), as on TCP.
static size_t stripe_begin(size_t len, int i, int k) {
  return static_cast<size_t>((static_cast<unsigned __int128>(len) * i) / k);
}
static uint64_t stripe_part(int i) { return i == 0 ? kPayloadPart : kStripePart + i - 1; }

void UcxChannel::send_payload(const char* buf, size_t len) {
  const int k = stripes(len);
  for (int i = 0; i < k; i++) {
    const size_t begin = stripe_begin(len, i, k);
    send_req_[1 + i] = post_send(buf + begin, stripe_begin(len, i + 1, k) - begin, stripe_part(i), i);
  }
}

void UcxChannel::recv_payload(char* buf, size_t len) {
  const int k = stripes(len);
  for (int i = 0; i < k; i++) {
    const size_t begin = stripe_begin(len, i, k);
    payload_req_[i] = post_recv(buf + begin, stripe_begin(len, i + 1, k) - begin, stripe_part(i), &payload_info_[i]);
  }
  recv_ = Recv::PAYLOAD;
}

// Whether every stripe of a payload of `len` bytes is in; each must be as long as its sender's.
bool UcxChannel::payload_arrived(size_t len) {
  const int k = stripes(len);
  for (int i = 0; i < k; i++)
    if (!finished(payload_req_[i], &payload_info_[i])) return false;
  for (int i = 0; i < k; i++)
    if (payload_info_[i].length != stripe_begin(len, i + 1, k) - stripe_begin(len, i, k)) corrupt();
  return true;
}

bool UcxChannel::progress_send(Transfer& t) {
  bool moved = false;
  if (send_of_ != &t) {
    if (!t.with_header) fail(ErrorCode::SYSTEM, peer_, "a send without its header");
    send_of_ = &t;
    if (t.len <= kInlineBytes) {
      std::memcpy(send_bounce_.data(), &t.hdr, kHeader);
      if (t.len) std::memcpy(send_bounce_.data() + kHeader, t.buf, t.len);
      send_req_[0] = post_send(send_bounce_.data(), kHeader + t.len, kHeaderPart);
    } else if (reads_ && t.len >= kReadMinBytes) {  // offered for reading; the answer ends it
      const ReadOffer offer{uint64_t(getpid()), reinterpret_cast<uint64_t>(t.buf),
                            reinterpret_cast<uint64_t>(&cookie_), cookie_.load()};
      std::memcpy(send_bounce_.data(), &t.hdr, kHeader);
      std::memcpy(send_bounce_.data() + kHeader, &offer, sizeof offer);
      answer_req_ = post_recv(&answer_in_, 1, kAckPart, &answer_info_);
      send_req_[0] = post_send(send_bounce_.data(), kHeader + sizeof offer, kHeaderPart);
      send_offered_ = true;
    } else {  // all at once: UCX keeps each endpoint's order on the wire
      send_req_[0] = post_send(&t.hdr, kHeader, kHeaderPart);
      send_payload(t.buf, t.len);
    }
    moved = true;
  }
  for (void*& r : send_req_)
    if (!finished(r)) return moved;
  if (send_offered_) {
    if (!finished(answer_req_)) return moved;
    send_offered_ = false;
    if (answer_in_ == kReadRefused) {  // the payload goes through UCX after all
      reads_ = false;
      send_payload(t.buf, t.len);
      return true;
    }
    if (answer_in_ != kReadOk) corrupt();
  }
  t.hdr_done = kHeader;
  t.done = t.len;
  send_of_ = nullptr;
  return true;
}

bool UcxChannel::progress_recv(Transfer& t) {
  bool moved = false;
  if (recv_of_ != &t) {
    recv_of_ = &t;
    moved = true;
    if (t.with_header) {
      recv_req_ = post_recv(recv_bounce_.data(), recv_bounce_.size(), kHeaderPart, &recv_info_);
      recv_ = Recv::HEADER;
    } else if (stashed_) {  // the body of the message whose header was read alone
      if (stash_.size() != t.len) corrupt();
      std::memcpy(t.buf, stash_.data(), t.len);
      stashed_ = false;
      t.done = t.len;
      recv_of_ = nullptr;
      return true;
    } else if (payload_follows_) {
      recv_payload(t.buf, t.len);
    } else if (offer_follows_) {
      if (offered_len_ != t.len) corrupt();
      offer_follows_ = false;
      recv_ = Recv::READ;
    } else {
      fail(ErrorCode::SYSTEM, peer_, "a body receive without its header");
    }
  }
  if (recv_ == Recv::READ) return read_offered(t) || moved;
  if (recv_ == Recv::HEADER) {
    if (!finished(recv_req_, &recv_info_)) return moved;
    header_arrived(t, recv_info_.length);
    if (recv_ == Recv::READ) return read_offered(t) || true;
  } else {
    if (!payload_arrived(t.len)) return moved;
    t.done = t.len;
    payload_follows_ = false;
    drain_ = {};
  }
  if (t.complete()) {
    recv_of_ = nullptr;
    recv_ = Recv::IDLE;
  }
  return true;
}

void UcxChannel::header_arrived(Transfer& t, size_t length) {
  if (length < kHeader) corrupt();
  std::memcpy(&t.got, recv_bounce_.data(), kHeader);
  t.hdr_done = kHeader;
  accept_header(t, peer_);  // throws on a mismatch; SPLITS may switch `t` to draining
  const uint64_t len = t.got.len;
  const bool inline_payload = len <= kInlineBytes;
  const bool offered = !inline_payload && length == kHeader + sizeof(ReadOffer);
  if (length != kHeader + (inline_payload ? len : 0) && !offered) corrupt();
  const bool header_only = t.len == 0 && len > 0;  // NONE: the caller posts the body next
  if (offered) {
    if (peer_errors_) corrupt();  // offers come from peers on this host only
    std::memcpy(&offer_, recv_bounce_.data() + kHeader, sizeof offer_);
    offered_len_ = len;
    if (header_only) offer_follows_ = true;
    else recv_ = Recv::READ;
  } else if (inline_payload) {
    if (header_only) {
      stash_.assign(recv_bounce_.data() + kHeader, recv_bounce_.data() + length);
      stashed_ = true;
    } else {
      if (!t.drain && t.len) std::memcpy(t.buf, recv_bounce_.data() + kHeader, t.len);
      t.done = t.len;
    }
  } else if (header_only) {
    payload_follows_ = true;
  } else {
    // A drained payload is received whole and dropped: UCX's rendezvous does not complete
    // the sender's side of a truncated receive. Its length passed accept_header (SPLITS
    // lengths are what the peer's own splits say).
    if (t.drain && t.len > kMaxDrainBytes) fail_splits(t.got, t.hdr, peer_);  // fail now, not allocate
    if (t.drain) drain_.resize(t.len);
    recv_payload(t.drain ? drain_.data() : t.buf, t.len);
  }
}

// Reads the next slice of an offered payload from the sender's memory; once all of it is
// in (or, draining, at once), answers so. Refuses when this rank may not read the sender.
bool UcxChannel::read_offered(Transfer& t) {
  if (answer_out_req_ && !finished(answer_out_req_, nullptr)) return false;  // the last answer
  const int pid = static_cast<int>(offer_.pid);
  auto cookie_holds = [&] {
    uint64_t cookie = 0;
    return read_process(pid, offer_.cookie_addr, &cookie, sizeof cookie) && cookie == offer_.cookie;
  };
  if (!peer_checked_) {
    if (!cookie_holds()) {
      offer_refused(t);
      return true;
    }
    peer_checked_ = true;
  }
  if (t.drain) t.done = t.len;
  if (t.done < t.len) {
    const size_t len = std::min(kReadSliceBytes, t.len - t.done);
    if (!read_process(pid, offer_.addr + t.done, t.buf + t.done, len)) fail_unreadable(peer_);
    t.done += len;
    if (t.done < t.len) return true;  // one slice per call: the operation's other transfers move
  }
  if (!t.drain && !cookie_holds())
    fail(ErrorCode::PEER_FAILURE, peer_,
         "rank " + std::to_string(peer_) + " gave up its send while it was being read (its operation failed)");
  answer_offer(kReadOk);
  recv_of_ = nullptr;
  recv_ = Recv::IDLE;
  return true;
}

void UcxChannel::answer_offer(char answer) {
  answer_out_ = answer;
  answer_out_req_ = post_send(&answer_out_, 1, kAckPart);
}

// This rank may not read the sender (ptrace rules, or its pid is of another namespace): say
// so, and receive the payload, which the sender now sends, through UCX.
void UcxChannel::offer_refused(Transfer& t) {
  answer_offer(kReadRefused);
  reads_ = false;
  if (t.drain) drain_.resize(t.len);
  recv_payload(t.drain ? drain_.data() : t.buf, t.len);
}

void UcxChannel::abandon(Transfer& t) {
  broken_ = true;
  if (&t == recv_of_) {
    // A cancelled receive completes in progress; until it has, UCX may still write t.buf.
    // Reads have nothing in flight: they are synchronous.
    std::vector<void**> reqs{&recv_req_};
    for (void*& r : payload_req_) reqs.push_back(&r);
    for (void** r : reqs)
      if (*r) u_.ucp_request_cancel(w_.h, *r);
    const auto until = Clock::now() + kCloseWait;
    for (void** r : reqs) {
      if (!*r) continue;
      while (u_.ucp_request_check_status(*r) == UCS_INPROGRESS && Clock::now() < until) u_.ucp_worker_progress(w_.h);
      u_.ucp_request_free(*r);
      *r = nullptr;
    }
    recv_of_ = nullptr;
    recv_ = Recv::IDLE;
  }
  if (&t == send_of_) {
    // Sends cannot be cancelled; the endpoint is force-closed (or dropped with the worker)
    // at release, and nothing progresses this worker before then. The answer's receive
    // writes only into this channel.
    for (void*& r : send_req_)
      if (r) u_.ucp_request_free(r), r = nullptr;
    if (answer_req_) u_.ucp_request_cancel(w_.h, answer_req_), u_.ucp_request_free(answer_req_), answer_req_ = nullptr;
    if (send_offered_) cookie_.fetch_add(1);  // seq_cst: before the caller can touch t.buf
    send_offered_ = false;
    send_of_ = nullptr;
  }
}

class UcxNet final : public Net {
 public:
  // rma: windows may use UCX RMA (COMM_WINDOW_RMA=1): the context asks for it, and the p2p
  // worker takes callers besides its driver (thread mode MULTI). Off, the net is as before.
  UcxNet(const Ucp& u, int rank, int endpoints, bool rma);
  ~UcxNet() override;
  NetCaps caps() const override { return NetCaps{}; }  // host memory: the engine reduces on the CPU
  std::string address() const override;
  std::unique_ptr<Channel> connect(int peer, Stream stream, const std::string& remote, bool same_host) override;
  std::unique_ptr<RmaWindow> rma_window(const RmaMemory& mem) override {
    return rma_ ? open_ucx_rma_window(rma_, mem) : nullptr;
  }
  std::string describe() const override;
  void forget() override {
    forgotten_ = true;
    for (UcxChannel* ch : channels_) ch->forget();
  }

 private:
  const Ucp& u_;
  const int rank_;
  const int endpoints_;  // per remote peer on the collective stream
  ucp_context_h ctx_ = nullptr;
  Worker workers_[2];
  std::shared_ptr<UcxRmaHub> rma_;  // windows over the p2p worker (window_ucx.h)
  void release();
  std::vector<UcxChannel*> channels_;  // owned by the engine's peers, destroyed before us
  bool forgotten_ = false;
};

UcxNet::UcxNet(const Ucp& u, int rank, int endpoints, bool rma) : u_(u), rank_(rank), endpoints_(endpoints) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = u_.ucp_config_read(nullptr, nullptr, &config);  // UCX_* variables apply
  if (st != UCS_OK) fail(ErrorCode::SYSTEM, -1, std::string("ucp_config_read: ") + u_.ucs_status_string(st));
  // CMA (process_vm_readv) from a peer that died aborts the whole process when the endpoint
  // has no error handling (UCX's cma_ep.c: a fatal error), which endpoints on one host do not
  // (see UcxChannel). So every transport but CMA, unless UCX_TLS chooses; large payloads on
  // one host are read by the channel itself instead (see the top).
  if (!std::getenv("UCX_TLS")) st = u_.ucp_config_modify(config, "TLS", "^cma");
  if (st != UCS_OK) fail(ErrorCode::SYSTEM, -1, std::string("ucp_config_modify: ") + u_.ucs_status_string(st));
  // UCX's TCP moves eager fragments of 8 KiB: a collective's chunks (512 KiB) then cost 64
  // sends each. Larger segments, unless the user set them. Before 1.17, ucp_config_modify
  // accepts a transport's setting but no transport takes it (each worker then warns of
  // "invalid configurations"): there the defaults stay.
  for (auto [name, value] : {std::pair{"TCP_TX_SEG_SIZE", "64k"}, std::pair{"TCP_RX_SEG_SIZE", "256k"}}) {
    if (u_.minor < kUcxTransportSettingsMinor || std::getenv((std::string("UCX_") + name).c_str())) continue;
    st = u_.ucp_config_modify(config, name, value);
    if (st != UCS_OK) fail(ErrorCode::SYSTEM, -1, std::string("ucp_config_modify ") + name + ": " + u_.ucs_status_string(st));
  }
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP | (rma ? UCP_FEATURE_RMA : 0);  // RMA: window_ucx.cc
  p.mt_workers_shared = 1;  // the two workers are driven by different threads
  // The floor's API: the engine uses nothing newer (an older library than the API asked for
  // would warn).
  st = u_.ucp_init_version(kUcxMajor, kUcxFloorMinor, &p, config, &ctx_);
  u_.ucp_config_release(config);
  if (st != UCS_OK) fail(ErrorCode::SYSTEM, -1, std::string("ucp_init: ") + u_.ucs_status_string(st));
  for (Worker& w : workers_) {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // One thread at a time (the engine's rule), except on the p2p worker, where a window's
    // caller posts RMA and progresses it while the p2p driver may be in the worker too.
    wp.thread_mode = rma && &w == &workers_[1] ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SERIALIZED;
    st = u_.ucp_worker_create(ctx_, &wp, &w.h);
    int fd = -1;
    if (st == UCS_OK) st = u_.ucp_worker_get_efd(w.h, &fd);
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    if (st == UCS_OK) st = u_.ucp_worker_query(w.h, &attr);
    if (st != UCS_OK) {
      release();  // the constructor throws: no destructor runs
      fail(ErrorCode::SYSTEM, -1, std::string("UCX worker: ") + u_.ucs_status_string(st));
    }
    w.efd = {fd};
    w.address.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    u_.ucp_worker_release_address(w.h, attr.address);
  }
  if (rma) rma_ = std::make_shared<UcxRmaHub>(u_, ctx_, workers_[1].h);
}

UcxNet::~UcxNet() {
  if (!forgotten_) release();
}

void UcxNet::release() {
  if (rma_) rma_->release();  // windows' registrations before the context goes
  for (Worker& w : workers_)
    if (w.h) u_.ucp_worker_destroy(w.h), w.h = nullptr;
  if (ctx_) u_.ucp_cleanup(ctx_), ctx_ = nullptr;
}

// [u32 endpoints per remote peer][u32 length of the collective worker's address][that
// address][the p2p worker's address]
std::string UcxNet::address() const {
  const uint32_t head[2] = {static_cast<uint32_t>(endpoints_), static_cast<uint32_t>(workers_[0].address.size())};
  return std::string(reinterpret_cast<const char*>(head), sizeof head) + workers_[0].address + workers_[1].address;
}

std::unique_ptr<Channel> UcxNet::connect(int peer, Stream stream, const std::string& remote, bool same_host) {
  uint32_t head[2] = {};
  const std::string bad = "bad UCX address from rank " + std::to_string(peer);
  if (remote.size() < sizeof head) fail(ErrorCode::SYSTEM, peer, bad);
  std::memcpy(head, remote.data(), sizeof head);
  const uint32_t n = head[1];
  if (remote.size() < sizeof head + n) fail(ErrorCode::SYSTEM, peer, bad);
  const std::string addr = stream == Stream::COLL ? remote.substr(sizeof head, n) : remote.substr(sizeof head + n);
  // Both ends stripe alike: the fewer endpoints of the two (they may have been set apart).
  const int fewer = std::clamp<int>(std::min<uint32_t>(head[0], endpoints_), 1, kMaxStripes);
  const int stripes = same_host || stream == Stream::P2P ? 1 : fewer;
  auto ch = std::make_unique<UcxChannel>(u_, workers_[static_cast<int>(stream)], peer, rank_, addr, same_host, stripes,
                                         stream == Stream::P2P ? rma_ : nullptr);
  channels_.push_back(ch.get());
  return ch;
}

std::string UcxNet::describe() const {
  char* text = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&text, &len);
  if (!f) fail_errno("open_memstream");
  u_.ucp_context_print_info(ctx_, f);
  std::fclose(f);
  std::string out(text, len);
  std::free(text);
  return out;
}

}  // namespace

std::unique_ptr<Net> open_ucx(int rank, int /*size*/, const NetOptions& opts) {
  const auto it = opts.find("endpoints");
  const int endpoints = it == opts.end() ? 1 : std::clamp(std::atoi(it->second.c_str()), 1, kMaxStripes);
  const auto rma = opts.find("rma");
  return std::make_unique<UcxNet>(load_ucp(opts), rank, endpoints, rma != opts.end() && rma->second == "1");
}

}  // namespace comm
