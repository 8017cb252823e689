// Wrapper for https://docs.nvidia.com/cuda/parallel-thread-execution/#parallel-synchronization-and-communication-instructions-cp-async-mbarrier-arrive
inline __device__ void
__cp_async_arrive(::cuda::barrier<::cuda::thread_scope_block> &__bar) {
  uint64 *mbar_ptr = ::cuda::device::barrier_native_handle(__bar);

  uint32 smem_int_mbar =
      static_cast<uint32>(__cvta_generic_to_shared(mbar_ptr));
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n"
               :: "r"(smem_int_mbar));
}

// Wrappers for https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cp-async
//
// burn-ulysses patch: the destination is a shared buffer and a byte offset, added in the shared
// window's 32 bits, where ptxas folds a constant offset into LDGSTS's address; added to the
// generic 64-bit pointer first, each copy's offset took instructions of its own. Renamed
// (`_at`) so that a call written for the old arguments fails to compile rather than mean
// something else.

// Only 16 byte size allows the `cg` modifier, so this is a more general version with `ca`. Executes
// a partial copy of `src_size` bytes.
template <size_t _Copy_size>
inline __device__ void
__cp_async_shared_global_at(void const *src_ptr, void *smem_buffer, uint32 smem_offset, int32 const &src_size) {
  static_assert(_Copy_size == 4 || _Copy_size == 8 || _Copy_size == 16,
                "cp.async.shared.global requires a copy size of 4, 8, or 16.");

  uint64 gmem_int_desc = reinterpret_cast<uint64>(src_ptr);
  uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_buffer)) + smem_offset;
  asm volatile("cp.async.ca.shared::cta.global [%0], [%1], %2, %3;\n"
               :: "r"(smem_int_ptr), "l"(gmem_int_desc), "n"(_Copy_size), "r"(src_size) : "memory");
}

// Specialized on copy size 16 to use `cg`. Executes a partial copy of `src_size` bytes.
template <>
inline __device__ void
__cp_async_shared_global_at<16>(void const *src_ptr, void *smem_buffer, uint32 smem_offset, int32 const &src_size) {
  uint64 gmem_int_desc = reinterpret_cast<uint64>(src_ptr);
  uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_buffer)) + smem_offset;
  asm volatile("cp.async.cg.shared::cta.global [%0], [%1], %2, %3;\n"
               :: "r"(smem_int_ptr), "l"(gmem_int_desc), "n"(16), "r"(src_size) : "memory");
}

// Only 16 byte size allows the `cg` modifier, so this is a more general version with `ca`. Executes
// a full copy.
template <size_t _Copy_size>
inline __device__ void
__cp_async_shared_global_at(void const *src_ptr, void *smem_buffer, uint32 smem_offset) {
  static_assert(_Copy_size == 4 || _Copy_size == 8 || _Copy_size == 16,
                "cp.async.shared.global requires a copy size of 4, 8, or 16.");

  uint64 gmem_int_desc = reinterpret_cast<uint64>(src_ptr);
  uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_buffer)) + smem_offset;
  asm volatile("cp.async.ca.shared::cta.global [%0], [%1], %2, %2;\n"
               :: "r"(smem_int_ptr), "l"(gmem_int_desc), "n"(_Copy_size) : "memory");
}

// Specialized on copy size 16 to use `cg`. Executes a full copy.
template <>
inline __device__ void
__cp_async_shared_global_at<16>(void const *src_ptr, void *smem_buffer, uint32 smem_offset) {
  uint64 gmem_int_desc = reinterpret_cast<uint64>(src_ptr);
  uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_buffer)) + smem_offset;
  asm volatile("cp.async.cg.shared::cta.global [%0], [%1], %2, %2;\n"
               :: "r"(smem_int_ptr), "l"(gmem_int_desc), "n"(16) : "memory");
}