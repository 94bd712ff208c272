#include "aead.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <new>

namespace kvt {

Aead::Aead(const uint8_t key[kKeyBytes]) : ctx_(EVP_CIPHER_CTX_new()) {
  if (!ctx_) throw std::bad_alloc();
  std::memcpy(key_, key, kKeyBytes);
}

Aead::~Aead() {
  EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(ctx_));
  std::memset(key_, 0, kKeyBytes);
}

namespace {
void nonce_of(uint64_t counter, uint8_t iv[12]) {
  std::memset(iv, 0, 12);
  std::memcpy(iv + 4, &counter, 8);
}
}  // namespace

bool Aead::seal(const uint8_t* in, size_t n, uint8_t* out, uint8_t* tag) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  uint8_t iv[12];
  nonce_of(counter_++, iv);
  // The key schedule is set once; later messages only change the nonce.
  if (!ready_ || !encrypt_) {
    if (EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key_, iv) != 1) return false;
    ready_ = true;
    encrypt_ = true;
  } else if (EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) != 1) {
    return false;
  }
  int len = 0;
  size_t done = 0;
  while (done < n) {  // EVP takes int lengths
    int chunk = static_cast<int>(std::min<size_t>(n - done, 1u << 30));
    if (EVP_EncryptUpdate(ctx, out + done, &len, in + done, chunk) != 1) return false;
    done += static_cast<size_t>(chunk);
  }
  if (EVP_EncryptFinal_ex(ctx, out + done, &len) != 1) return false;
  return EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) == 1;
}

bool Aead::open(const uint8_t* in, size_t n, uint8_t* out, const uint8_t* tag) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  uint8_t iv[12];
  nonce_of(counter_++, iv);
  if (!ready_ || encrypt_) {
    if (EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key_, iv) != 1) return false;
    ready_ = true;
    encrypt_ = false;
  } else if (EVP_DecryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) != 1) {
    return false;
  }
  int len = 0;
  size_t done = 0;
  while (done < n) {
    int chunk = static_cast<int>(std::min<size_t>(n - done, 1u << 30));
    if (EVP_DecryptUpdate(ctx, out + done, &len, in + done, chunk) != 1) return false;
    done += static_cast<size_t>(chunk);
  }
  uint8_t t[kTagBytes];
  std::memcpy(t, tag, kTagBytes);
  if (EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kTagBytes, t) != 1) return false;
  return EVP_DecryptFinal_ex(ctx, out + done, &len) == 1;
}

bool BounceBudget::acquire(uint64_t n, std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  if (n > limit_) return false;
  if (!cv_.wait_for(lock, wait, [&] { return used_ + n <= limit_; })) return false;
  used_ += n;
  return true;
}

void BounceBudget::release(uint64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    used_ -= n;
  }
  cv_.notify_all();
}

uint64_t BounceBudget::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

}  // namespace kvt
