//! Loads compiled GPU kernels (cubins) and launches them through the CUDA driver API, which is
//! opened at run time (`libcuda.so.1`): the extension links nothing of CUDA, so it imports on
//! machines without a GPU, where `Driver::open` is an error.
//!
//! A launch passes each buffer as a device pointer and then `trailing_nulls` null pointers: the
//! scratch-buffer parameters a Triton kernel declares after its own (unused at size zero). The
//! launch goes on the caller's stream in the calling thread's current context, which is the
//! device's primary context torch uses (made current here if the thread has none).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::sync::Arc;

type CuResult = c_int;
type CuContext = *mut c_void;
type CuModule = *mut c_void;
type CuFunction = *mut c_void;
type CuStream = *mut c_void;

const CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: c_int = 0;
const CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: c_int = 1;
const CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
const CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
/// Dynamic shared memory a kernel may take without opting in.
const DEFAULT_SHARED_LIMIT: u32 = 48 * 1024;

#[derive(Debug, Clone)]
pub struct CudaError(pub String);

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CudaError {}

/// The driver entry points this module calls, resolved once per `Driver::open`.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, c_int) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    module_unload: unsafe extern "C" fn(CuModule) -> CuResult,
    func_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuFunction) -> CuResult,
    func_set_attribute: unsafe extern "C" fn(CuFunction, c_int, c_int) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CuStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// The CUDA driver library, opened and initialized.
pub struct Driver {
    api: Api,
}

// SAFETY: the table holds plain function pointers into the driver, which is thread-safe.
unsafe impl Send for Driver {}
unsafe impl Sync for Driver {}

fn symbol<T: Copy>(lib: *mut c_void, name: &str) -> Result<T, CudaError> {
    let c = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: dlsym on a handle dlopen returned; the caller names the symbol's true type.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        return Err(CudaError(format!("the CUDA driver has no {name}")));
    }
    debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: T is a function pointer type of the symbol's signature (same size as a pointer).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Driver {
    /// Opens `libcuda.so.1` (already loaded wherever torch uses the GPU) and initializes it.
    pub fn open() -> Result<Arc<Driver>, CudaError> {
        let name = CString::new("libcuda.so.1").expect("no NUL");
        // SAFETY: dlopen with a valid C string; the handle is never closed (the driver stays).
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(CudaError("the CUDA driver (libcuda.so.1) cannot be loaded".into()));
        }
        let api = Api {
            init: symbol(lib, "cuInit")?,
            ctx_get_current: symbol(lib, "cuCtxGetCurrent")?,
            ctx_set_current: symbol(lib, "cuCtxSetCurrent")?,
            device_get: symbol(lib, "cuDeviceGet")?,
            primary_ctx_retain: symbol(lib, "cuDevicePrimaryCtxRetain")?,
            device_get_attribute: symbol(lib, "cuDeviceGetAttribute")?,
            module_load_data: symbol(lib, "cuModuleLoadData")?,
            module_get_function: symbol(lib, "cuModuleGetFunction")?,
            module_unload: symbol(lib, "cuModuleUnload")?,
            func_get_attribute: symbol(lib, "cuFuncGetAttribute")?,
            func_set_attribute: symbol(lib, "cuFuncSetAttribute")?,
            launch_kernel: symbol(lib, "cuLaunchKernel")?,
            get_error_string: symbol(lib, "cuGetErrorString")?,
        };
        let driver = Driver { api };
        // SAFETY: cuInit takes flags 0.
        driver.check(unsafe { (driver.api.init)(0) }, "cuInit")?;
        Ok(Arc::new(driver))
    }

    fn check(&self, r: CuResult, what: &str) -> Result<(), CudaError> {
        if r == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static string, or leaves it null.
        unsafe { (self.api.get_error_string)(r, &mut text) };
        let msg = if text.is_null() {
            format!("error {r}")
        } else {
            // SAFETY: a NUL-terminated static string of the driver.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(CudaError(format!("{what} failed: {msg}")))
    }

    /// Makes `device`'s primary context current on this thread when the thread has none.
    fn ensure_context(&self, device: i32) -> Result<(), CudaError> {
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: out-pointers to locals.
        unsafe {
            self.check((self.api.ctx_get_current)(&mut ctx), "cuCtxGetCurrent")?;
            if !ctx.is_null() {
                return Ok(());
            }
            let mut dev: c_int = 0;
            self.check((self.api.device_get)(&mut dev, device), "cuDeviceGet")?;
            self.check((self.api.primary_ctx_retain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            self.check((self.api.ctx_set_current)(ctx), "cuCtxSetCurrent")
        }
    }
}

/// What a kernel needs at launch besides its buffers.
#[derive(Debug, Clone, Copy)]
pub struct LaunchConfig {
    pub num_warps: u32,
    /// Dynamic shared memory, bytes.
    pub shared: u32,
    /// Null pointer parameters after the buffers.
    pub trailing_nulls: u32,
}

/// One kernel of a loaded cubin; the module is unloaded when it is dropped.
pub struct Kernel {
    driver: Arc<Driver>,
    module: CuModule,
    function: CuFunction,
    config: LaunchConfig,
    device: i32,
}

// SAFETY: module and function handles may be used from any thread of the context's process.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Loads `cubin` on `device` and looks up kernel `name` in it.
    pub fn load(driver: &Arc<Driver>, cubin: &[u8], name: &str, device: i32, config: LaunchConfig) -> Result<Kernel, CudaError> {
        let d = driver.as_ref();
        d.ensure_context(device)?;
        let cname = CString::new(name).map_err(|_| CudaError(format!("kernel name {name:?} has a NUL")))?;
        let mut module: CuModule = std::ptr::null_mut();
        // the driver reads the image's own size from its ELF header: refuse anything else
        if cubin.len() < 4 || &cubin[..4] != b"\x7fELF" {
            return Err(CudaError(format!("the binary of {name} is not a cubin")));
        }
        // SAFETY: `cubin` is a complete ELF image that outlives the call.
        d.check(unsafe { (d.api.module_load_data)(&mut module, cubin.as_ptr().cast()) }, "cuModuleLoadData")?;
        // from here on, an error unloads the module (Drop)
        let mut kernel = Kernel { driver: driver.clone(), module, function: std::ptr::null_mut(), config, device };
        // SAFETY: a loaded module and a NUL-terminated name.
        d.check(unsafe { (d.api.module_get_function)(&mut kernel.function, module, cname.as_ptr()) }, "cuModuleGetFunction")?;
        kernel.check_limits(name)?;
        Ok(kernel)
    }

    fn func_attribute(&self, attribute: c_int) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: a loaded function and an out-pointer to a local.
        self.driver.check(unsafe { (self.driver.api.func_get_attribute)(&mut v, attribute, self.function) }, "cuFuncGetAttribute")?;
        Ok(v)
    }

    /// The block fits the function, and shared memory past the default limit is opted into.
    fn check_limits(&self, name: &str) -> Result<(), CudaError> {
        let threads = self.config.num_warps * 32;
        let max_threads = self.func_attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
        if threads as i64 > max_threads as i64 {
            return Err(CudaError(format!("{name}: {threads} threads a block, the function allows {max_threads}")));
        }
        if self.config.shared > DEFAULT_SHARED_LIMIT {
            let d = self.driver.as_ref();
            let mut optin: c_int = 0;
            // SAFETY: out-pointer to a local.
            d.check(
                unsafe { (d.api.device_get_attribute)(&mut optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.device) },
                "cuDeviceGetAttribute",
            )?;
            let fixed = self.func_attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
            if self.config.shared as i64 + fixed as i64 > optin as i64 {
                return Err(CudaError(format!("{name}: {} bytes of shared memory, the device allows {optin}", self.config.shared)));
            }
            // SAFETY: a loaded function; the value is within the device's opt-in limit.
            d.check(
                unsafe { (d.api.func_set_attribute)(self.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - fixed) },
                "cuFuncSetAttribute",
            )?;
        }
        Ok(())
    }

    /// Launches `grid` blocks on `stream` (a `CUstream`, 0 for the legacy default stream) with
    /// `pointers` as the kernel's buffer parameters.
    pub fn launch(&self, grid: u32, stream: u64, pointers: &[u64]) -> Result<(), CudaError> {
        let d = self.driver.as_ref();
        d.ensure_context(self.device)?;
        let mut values: Vec<u64> = Vec::with_capacity(pointers.len() + self.config.trailing_nulls as usize);
        values.extend_from_slice(pointers);
        values.extend(std::iter::repeat_n(0u64, self.config.trailing_nulls as usize));
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // SAFETY: `params` points at one 8-byte value per kernel parameter (device pointers),
        // alive across the call; the function and stream belong to the current context.
        let r = unsafe {
            (d.api.launch_kernel)(
                self.function,
                grid,
                1,
                1,
                self.config.num_warps * 32,
                1,
                1,
                self.config.shared,
                stream as usize as CuStream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        d.check(r, "cuLaunchKernel")
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: the module was loaded by this kernel; an error (a context already torn down at
        // exit) leaves nothing to free.
        unsafe { (self.driver.api.module_unload)(self.module) };
    }
}

/// The number of parameters of kernel `name`'s `.entry` in PTX text, or None when it is absent.
pub fn ptx_param_count(ptx: &str, name: &str) -> Option<usize> {
    let start = ptx.find(&format!(".entry {name}("))?;
    let rest = &ptx[start..];
    let end = rest.find(')')?;
    Some(rest[..end].matches(".param").count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_params_are_counted_in_the_named_entry() {
        let ptx = ".visible .entry other(\n\t.param .u64 a\n)\n.visible .entry k0(\n\t.param .u64 .ptr .global .align 1 k0_param_0,\n\t.param .u64 .ptr .global .align 1 k0_param_1,\n\t.param .u64 .ptr .global .align 1 k0_param_2\n)\n{\n\t.reg .b32 %r<3>;\n}";
        assert_eq!(ptx_param_count(ptx, "k0"), Some(3));
        assert_eq!(ptx_param_count(ptx, "other"), Some(1));
        assert_eq!(ptx_param_count(ptx, "k1"), None);
    }

    #[test]
    fn a_machine_without_the_driver_is_an_error_not_a_crash() {
        // on a GPU machine this opens the driver; elsewhere it must be a plain error
        match Driver::open() {
            Ok(d) => {
                assert!(Kernel::load(&d, b"not a cubin", "k", 0, LaunchConfig { num_warps: 4, shared: 0, trailing_nulls: 0 }).is_err())
            }
            Err(e) => assert!(e.0.contains("CUDA driver"), "{e}"),
        }
    }
}
