#[allow(dead_code, unused_imports)] // temporary: main does not use the order API yet
mod order;

fn main() {
    println!("Hello, world!");
}
