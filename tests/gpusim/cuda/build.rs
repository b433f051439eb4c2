fn main() {
    // Programs link against libcuda.so.1 by soname, as with the real driver.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
