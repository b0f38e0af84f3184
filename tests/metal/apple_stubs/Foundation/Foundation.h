// Foundation/Foundation.h: a stand-in for Apple's header, for the Linux syntax check of
// csrc/backend/metal/metal_backend.mm only (tests/metal/test_apple_host.py). It declares what that file uses,
// with the names, types and selectors of the macOS SDK (arm64), and nothing else. Nothing here is ever linked:
// the real backend is built against the system frameworks on a Mac.
#pragma once

typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef bool BOOL;  // objc/objc.h on arm64
#define YES __objc_yes
#define NO __objc_no
#define nil nullptr

// The C++ forms of Apple's enum macros (CFAvailability.h).
#define NS_ENUM(type, name) enum name : type name; enum name : type
#define NS_OPTIONS(type, name) type name; enum : type
#define NS_RETURNS_RETAINED __attribute__((ns_returns_retained))
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property (readonly) const char* UTF8String NS_RETURNS_INNER_POINTER;
@end

@interface NSArray<__covariant ObjectType> : NSObject
@property (readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end

@interface NSError : NSObject
@property (readonly, copy) NSString* localizedDescription;
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end
